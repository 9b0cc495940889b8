"""This machine as the one node: ``LocalMachine``, the embedded default provider.

Its GPUs come from ``nvidia-smi`` when there is one (else it is CPU only), and the NVIDIA Container Toolkit's
version from ``nvidia-ctk --version``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from pydantic import Field

from blocks.base.nvidia import (
    NVIDIA_SMI_QUERY,
    TOOLKIT_MISSING,
    parse_ctk_version,
    parse_cuda_version,
    parse_nvidia_smi,
)
from blocks.base.provider import NodeProvider, NodeRequirements
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError
from blocks.records import GpuInfo, Node


class LocalMachine(NodeProvider):
    """This machine, as the one node (its GPUs from nvidia-smi, or none)."""

    _block_type_name = "gpuferry Local Machine"
    _description = "Provides this machine as the only node; GPUs are read from nvidia-smi when present."

    nvidia_smi: str = Field("nvidia-smi", description="nvidia-smi command (a path or a name on PATH).")
    nvidia_ctk: str = Field("nvidia-ctk", description="nvidia-ctk command (NVIDIA Container Toolkit).")

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        if count != 1:
            raise ConfigurationError(
                f"resources.nodes={count}: the local machine is one node; set nodes=1 or use a Slurm stack"
            )
        return [Node(name=socket.gethostname(), provider=self.get_block_type_slug(), labels={"run": key})]

    def inspect(self, nodes: list[Node]) -> list[Node]:
        gpus = self._gpus()
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
        toolkit = self._toolkit()
        return [
            n.model_copy(
                update={
                    "gpus": gpus,
                    "cpus": os.cpu_count() or 1,
                    "memory_mib": mem,
                    "labels": {**n.labels, "toolkit": toolkit},
                }
            )
            for n in nodes
        ]

    def release(self, nodes: list[Node]) -> None:
        """Nothing to give back: the machine stays."""

    def host_inventory(self) -> list[Node]:
        return self.inspect(self.acquire(1, NodeRequirements(), "inventory"))

    def _gpus(self) -> list[GpuInfo]:
        exe = shutil.which(self.nvidia_smi)
        if exe is None:
            return []
        try:
            query = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30, check=True)
            banner = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
        except (subprocess.SubprocessError, OSError):
            return []  # an nvidia-smi that cannot talk to a driver: no usable GPU
        return parse_nvidia_smi(query.stdout, parse_cuda_version(banner))

    def _toolkit(self) -> str:
        """The NVIDIA Container Toolkit's version, or ``missing``."""
        exe = shutil.which(self.nvidia_ctk)
        if exe is None:
            return TOOLKIT_MISSING
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        except (subprocess.SubprocessError, OSError):
            return TOOLKIT_MISSING  # present but broken: not usable
        return parse_ctk_version(out) or TOOLKIT_MISSING

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The GPUs nvidia-smi lists here (none is fine: the jobs run on CPUs)."""
        gpus = self._gpus()
        probe.info(
            "GPUs",
            ", ".join(f"{g.name} ({g.memory_mib} MiB)" for g in gpus)
            if gpus
            else f"none ({self.nvidia_smi} {'finds no GPU' if shutil.which(self.nvidia_smi) else 'not installed'}): "
            "jobs run on CPUs",
        )
        return probe.rows
