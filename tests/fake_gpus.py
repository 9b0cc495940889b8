"""Stand-in GPUs for the Docker backends' tests: character devices, a CDI spec naming them by index and by UUID,
and an ``nvidia-smi`` that reports them, so that a container really gets the chosen devices.

The device nodes live in a temporary directory of the test's own. podman reads CDI specs only from its
machine-wide directories (/etc/cdi, /var/run/cdi), so the spec goes to /var/run/cdi under a file name and a CDI
kind of its own (``gpuferry-<random>.test/gpu``: no real GPU's name) and is removed afterwards. What cannot run
here: the NVIDIA runtime and real CUDA — the devices are major 195 nodes with no driver behind them.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CDI_DIR = Path("/var/run/cdi")
NVIDIA_MAJOR = 195


@dataclass(frozen=True)
class FakeGpus:
    kind: str  # the CDI kind (vendor/class) of these GPUs
    uuids: tuple[str, ...]  # by index
    nvidia_smi: str  # an nvidia-smi that reports them
    spec_path: Path

    def env_name(self, index: int) -> str:
        """The variable the CDI spec sets in a container that got GPU ``index``."""
        return f"FAKE_GPU_{index}_UUID"


@contextmanager
def fake_gpus(root: Path, count: int = 4) -> Iterator[FakeGpus]:
    tag = uuid.uuid4().hex[:8]
    kind = f"gpuferry-{tag}.test/gpu"
    devices = root / "dev"
    devices.mkdir(parents=True)
    uuids = tuple(f"GPU-{tag}-{i:04d}-4000-8000-{uuid.uuid4().hex[:12]}" for i in range(count))
    cdi_devices = []
    for i, gpu_uuid in enumerate(uuids):
        node = devices / f"fakenvidia{i}"
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 200 + i))
        edits = {
            "deviceNodes": [{"path": f"/dev/nvidia{i}", "hostPath": str(node)}],
            "env": [f"FAKE_GPU_{i}_UUID={gpu_uuid}"],
        }
        cdi_devices += [{"name": str(i), "containerEdits": edits}, {"name": gpu_uuid, "containerEdits": edits}]
    spec = {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": cdi_devices,
        "containerEdits": {"env": ["FAKE_GPU_DRIVER=gpuferry-test"]},
    }
    created_dir = not CDI_DIR.exists()
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    spec_path = CDI_DIR / f"gpuferry-test-{tag}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    query = "".join(f"{i}, NVIDIA Fake-80GB, 81920, 550.54.15, {u}\n" for i, u in enumerate(uuids))
    (root / "query.csv").write_text(query)
    (root / "banner.txt").write_text("| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |\n")
    smi = root / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nif [ -n "$1" ]; then cat {root}/query.csv; else cat {root}/banner.txt; fi\n')
    smi.chmod(0o755)
    try:
        yield FakeGpus(kind=kind, uuids=uuids, nvidia_smi=str(smi), spec_path=spec_path)
    finally:
        spec_path.unlink(missing_ok=True)
        if created_dir:
            try:
                CDI_DIR.rmdir()
            except OSError:
                pass  # someone else's spec arrived meanwhile
