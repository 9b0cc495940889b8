"""What NVIDIA's tools say about a host, read (pure): ``nvidia-smi``'s GPU query and banner, ``nvidia-ctk --version``.

Shared by the providers that look at a machine themselves: this one (``blocks/local/provider.py``) and your own
hosts over SSH (``blocks/hosts/facts.py``). The readers are tested against real output (an H200's is in the tests).
"""

from __future__ import annotations

import re

from blocks.records import GpuInfo

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,driver_version,uuid", "--format=csv,noheader,nounits"]
TOOLKIT_MISSING = "missing"  # labels["toolkit"] of a node without the NVIDIA Container Toolkit
_CTK_VERSION = re.compile(r"version\s+v?([0-9][0-9A-Za-z.+~-]*)")


def parse_nvidia_smi(csv_text: str, cuda_version: str | None = None) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader,nounits``
    (the UUID column may be missing: older callers asked without it)."""
    gpus = []
    for line in csv_text.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) not in (4, 5):
            raise ValueError(f"expected 4 or 5 comma-separated fields, got {len(parts)} in {line!r}")
        index, name, memory, driver = parts[:4]
        uuid = parts[4] if len(parts) == 5 and parts[4] else None
        gpus.append(
            GpuInfo(
                index=int(index),
                name=name,
                memory_mib=int(float(memory)),
                driver_version=driver,
                cuda_version=cuda_version,
                uuid=uuid,
            )
        )
    return gpus


def parse_cuda_version(nvidia_smi_banner: str) -> str | None:
    """The 'CUDA Version: 12.4' field of plain ``nvidia-smi`` output."""
    marker = "CUDA Version:"
    if marker not in nvidia_smi_banner:
        return None
    return nvidia_smi_banner.split(marker, 1)[1].split()[0].strip("|")


def parse_ctk_version(text: str) -> str | None:
    """The version in ``nvidia-ctk --version`` output ('NVIDIA Container Toolkit CLI version 1.15.0')."""
    match = _CTK_VERSION.search(text)
    return match.group(1) if match else None
