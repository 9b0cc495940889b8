"""The provision step's interface: where the nodes, and their GPUs, come from.

``NodeProvider`` is the interface every provider implements: ``acquire(count, requirements)``
hands out nodes (re-running it reuses what it already acquired), ``check(nodes, requirements)``
verifies them before any work lands on them, ``bootstrap(nodes, requirements)`` makes them ready
(checking before it changes anything, so a second run changes nothing; by default it only checks),
``release(nodes)`` gives them back.

A provider that works on several nodes at once reports every node's outcome: a failure on one node
does not hide the others' results. ``NodeFailures`` carries all of them (``nodes``, each with its
``state`` and, when it failed, ``labels["error"]``) and lists the failed ones in its message.

``ClusterManaged`` is the provider of a standing cluster, whose scheduler owns the nodes: it talks to no
system, so it lives here. The others have folders of their own (``blocks/local/provider.py``,
``blocks/hosts/``, ``blocks/aws/``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field

from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.records import Node


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
    lines = "\n  ".join(
        str(exc)
        if str(exc).startswith(f"{node.name}:") or str(exc).startswith(f"{node.name} ")
        else f"{node.name}: {exc}"
        for node, exc in failures
    )
    message = (
        f"{action} failed on {len(failures)} of {len(nodes)} node(s)"
        f"{' (finished on: ' + ', '.join(ok) + ')' if ok else ''}:\n  {lines}"
    )
    transient = all(isinstance(exc, TransientError) for _, exc in failures)
    raise (NodesUnreachable if transient else NodesFailed)(message, nodes)


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
            problems.append(f"{node.name}: driver {gpu.driver_version} is older than {requirements.min_driver_version}")
    return problems


class NodeProvider(Block, ABC):
    """Hands out nodes to train on and takes them back."""

    _block_type_name = "gpuferry Node Provider"

    @abstractmethod
    def self_check(self, probe: Probe) -> list[CheckRow]:
        """What ``gpuferry check`` reports of this backend: each check a row of ``probe`` (``blocks/checks.py``). It
        only reads, or writes a probe object and deletes it; ``Stack.check`` runs it with a deadline."""

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


class ClusterManaged(NodeProvider):
    """Nodes the cluster's scheduler owns (a standing Slurm cluster): nothing to acquire or release.

    The scheduler places the job on nodes with the GPUs it asked for (and refuses a request no
    node can meet), so there is no node to check from here; the run records one logical node.
    """

    _block_type_name = "gpuferry Cluster-Managed Nodes"
    _description = "For standing clusters: the scheduler owns the nodes; nothing is acquired or released."

    cluster_name: str = Field("cluster", description="Name recorded for the run's nodes (e.g. the Slurm cluster).")

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        return [
            Node(
                name=self.cluster_name,
                provider=self.get_block_type_slug(),
                state="ready",
                labels={"run": key, "nodes": str(count), "gpus_per_node": str(requirements.gpus)},
            )
        ]

    def inspect(self, nodes: list[Node]) -> list[Node]:
        return nodes

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        return nodes  # the scheduler enforces the request

    def release(self, nodes: list[Node]) -> None:
        """Nothing to give back: the cluster's nodes stay."""

    def self_check(self, probe: Probe) -> list[CheckRow]:
        probe.info("nodes", f"owned by the scheduler of {self.cluster_name} (checked with the compute backend)")
        return probe.rows
