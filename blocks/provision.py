"""Node providers: where the GPUs come from.

``NodeProvider`` is the interface every provider implements: ``acquire(count, requirements)``
hands out nodes (re-running it reuses what it already acquired), ``check(nodes, requirements)``
verifies them before any work lands on them, ``bootstrap(nodes, requirements)`` makes them ready
(checking before it changes anything, so a second run changes nothing; by default it only checks),
``release(nodes)`` gives them back.

A provider that works on several nodes at once reports every node's outcome: a failure on one node
does not hide the others' results. ``NodeFailures`` carries all of them (``nodes``, each with its
``state`` and, when it failed, ``labels["error"]``) and lists the failed ones in its message.

The embedded default, ``LocalMachine``, is this machine: its GPUs from ``nvidia-smi`` when there is
one, else CPU only, and the NVIDIA Container Toolkit's version from ``nvidia-ctk --version``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from abc import ABC, abstractmethod

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.specs import GpuInfo, Node

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,driver_version,uuid", "--format=csv,noheader,nounits"]
TOOLKIT_MISSING = "missing"  # labels["toolkit"] of a node without the NVIDIA Container Toolkit
_CTK_VERSION = re.compile(r"version\s+v?([0-9][0-9A-Za-z.+~-]*)")


class NodeRequirements(BaseModel):
    """What each node must offer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(0, ge=0)
    min_gpu_memory_mib: int = Field(0, ge=0)
    min_driver_version: str | None = None


# Node.state values the providers set.
STATE_ACQUIRED = "acquired"  # handed out, not yet checked
STATE_READY = "ready"  # checked (and bootstrapped): work may land on it
STATE_FAILED = "failed"  # a check or a bootstrap step failed: labels["error"] says which and why
STATE_UNREACHABLE = "unreachable"  # could not be reached, after bounded retries


class NodeFailures(GpuferryError):
    """One or more nodes failed; ``nodes`` holds the outcome of every node, the successful ones too."""

    def __init__(self, message: str, nodes: list[Node] | tuple[Node, ...] = ()) -> None:
        super().__init__(message)
        self.nodes = list(nodes)

    def __reduce__(self) -> tuple[type, tuple[str, list[Node]]]:  # picklable with its nodes
        return (type(self), (str(self), self.nodes))

    @property
    def failed(self) -> list[Node]:
        return [n for n in self.nodes if n.state in (STATE_FAILED, STATE_UNREACHABLE)]


class NodesFailed(NodeFailures, ConfigurationError):
    """At least one node failed a check or a step that retrying will not fix."""


class NodesUnreachable(NodeFailures, TransientError):
    """Every failed node was unreachable (after the provider's own retries); a later attempt may succeed."""


def raise_for_failures(action: str, outcomes: list[tuple[Node, BaseException | None]]) -> list[Node]:
    """The nodes when every outcome succeeded; else one error listing each failed node and why."""
    nodes = [node for node, _ in outcomes]
    failures = [(node, exc) for node, exc in outcomes if exc is not None]
    if not failures:
        return nodes
    ok = [node.name for node, exc in outcomes if exc is None]
    lines = "\n  ".join(str(exc) if str(exc).startswith(f"{node.name}:") or str(exc).startswith(f"{node.name} ")
                         else f"{node.name}: {exc}" for node, exc in failures)  # fmt: skip
    message = (
        f"{action} failed on {len(failures)} of {len(nodes)} node(s)"
        f"{' (finished on: ' + ', '.join(ok) + ')' if ok else ''}:\n  {lines}"
    )
    transient = all(isinstance(exc, TransientError) for _, exc in failures)
    raise (NodesUnreachable if transient else NodesFailed)(message, nodes)


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
        gpus.append(GpuInfo(index=int(index), name=name, memory_mib=int(float(memory)), driver_version=driver,
                            cuda_version=cuda_version, uuid=uuid))  # fmt: skip
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


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def check_node(node: Node, requirements: NodeRequirements) -> list[str]:
    """Failed checks of one node, each naming what was found and what is required."""
    problems = []
    if len(node.gpus) < requirements.gpus:
        problems.append(f"{node.name}: {len(node.gpus)} GPU(s) found, {requirements.gpus} required")
    for gpu in node.gpus[: requirements.gpus]:
        if gpu.memory_mib < requirements.min_gpu_memory_mib:
            problems.append(
                f"{node.name}: GPU {gpu.index} ({gpu.name}) has {gpu.memory_mib} MiB, "
                f"{requirements.min_gpu_memory_mib} MiB required"
            )
        if requirements.min_driver_version and _version_tuple(gpu.driver_version) < _version_tuple(
            requirements.min_driver_version
        ):
            problems.append(
                f"{node.name}: driver {gpu.driver_version} is older than {requirements.min_driver_version}"
            )
    return problems


class NodeProvider(Block, ABC):
    """Hands out nodes to train on and takes them back."""

    _block_type_name = "gpuferry Node Provider"

    @abstractmethod
    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        """``count`` nodes for the run ``key``; acquiring again for the same key reuses them."""

    @abstractmethod
    def inspect(self, nodes: list[Node]) -> list[Node]:
        """The nodes with what they really have (GPUs, driver, CUDA), read from the nodes themselves."""

    @abstractmethod
    def release(self, nodes: list[Node]) -> None:
        """Give the nodes back; releasing twice is harmless."""

    def host_inventory(self) -> list[Node]:
        """The hosts this provider always has, inspected (their GPUs), without acquiring anything; none for a
        provider that makes nodes on demand. Backends that choose GPUs themselves (Docker hosts) read it."""
        return []

    def bootstrap(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """Make the nodes ready for work and return them checked.

        Every step checks before it changes, so a second run changes nothing. The default has
        nothing to set up: it only checks.
        """
        return self.check(nodes, requirements)

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """Inspect the nodes and fail, naming each node and check, when one falls short."""
        inspected = self.inspect(nodes)
        problems = [p for node in inspected for p in check_node(node, requirements)]
        if problems:
            raise ConfigurationError("node preflight failed:\n  " + "\n  ".join(problems))
        return inspected


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
        return [n.model_copy(update={"gpus": gpus, "cpus": os.cpu_count() or 1, "memory_mib": mem,
                                     "labels": {**n.labels, "toolkit": toolkit}}) for n in nodes]  # fmt: skip

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
        probe.info("GPUs", ", ".join(f"{g.name} ({g.memory_mib} MiB)" for g in gpus) if gpus else
                   f"none ({self.nvidia_smi} {'finds no GPU' if shutil.which(self.nvidia_smi) else 'not installed'}): "
                   "jobs run on CPUs")
        return probe.rows


class ClusterManaged(NodeProvider):
    """Nodes the cluster's scheduler owns (a standing Slurm cluster): nothing to acquire or release.

    The scheduler places the job on nodes with the GPUs it asked for (and refuses a request no
    node can meet), so there is no node to check from here; the run records one logical node.
    """

    _block_type_name = "gpuferry Cluster-Managed Nodes"
    _description = "For standing clusters: the scheduler owns the nodes; nothing is acquired or released."

    cluster_name: str = Field("cluster", description="Name recorded for the run's nodes (e.g. the Slurm cluster).")

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        return [Node(name=self.cluster_name, provider=self.get_block_type_slug(), state="ready",
                     labels={"run": key, "nodes": str(count), "gpus_per_node": str(requirements.gpus)})]  # fmt: skip

    def inspect(self, nodes: list[Node]) -> list[Node]:
        return nodes

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        return nodes  # the scheduler enforces the request

    def release(self, nodes: list[Node]) -> None:
        """Nothing to give back: the cluster's nodes stay."""

    def self_check(self, probe: Probe) -> list[CheckRow]:
        probe.info("nodes", f"owned by the scheduler of {self.cluster_name} (checked with the compute backend)")
        return probe.rows
