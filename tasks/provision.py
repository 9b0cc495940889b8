"""Provision and release nodes."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from blocks.base.provider import NodeFailures, NodeProvider, NodeRequirements
from blocks.records import Node
from blocks.stack import Stack
from tasks.retry import retry_options


def inventory_rows(nodes: list[Node]) -> list[dict[str, str]]:
    return [
        {
            "host": n.name,
            "provider": n.provider,
            "gpus": ", ".join(
                f"{g.index}: {g.name} ({g.memory_mib} MiB{', ' + g.uuid if g.uuid else ''})" for g in n.gpus
            )
            or "none (CPU only)",
            "driver": n.gpus[0].driver_version if n.gpus else "-",
            "cuda": (n.gpus[0].cuda_version or "-") if n.gpus else "-",
            "toolkit": n.labels.get("toolkit", "-"),
            "cpus": str(n.cpus),
            "memory_mib": str(n.memory_mib),
            "state": n.state + (f": {n.labels['error']}" if "error" in n.labels else ""),
        }
        for n in nodes
    ]


@task(name="provision", **retry_options(retries=3))
def provision_nodes(provider: NodeProvider, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
    """Acquire ``count`` nodes, bootstrap and check them; if that fails they are released at once."""
    nodes = provider.acquire(count, requirements, key)
    try:
        checked = provider.bootstrap(nodes, requirements)
    except NodeFailures as exc:  # every node's outcome, the failed ones named: the inventory shows them
        create_table_artifact(key="node-inventory", table=inventory_rows(exc.nodes), description="Nodes of this run")
        _release_after_failure(provider, nodes, exc)
        raise
    except BaseException as exc:
        _release_after_failure(provider, nodes, exc)
        raise
    create_table_artifact(key="node-inventory", table=inventory_rows(checked), description="Nodes of this run")
    return checked


def _release_after_failure(provider: NodeProvider, nodes: list[Node], cause: BaseException) -> None:
    """Release what was acquired; a failing release is logged and noted, never hiding ``cause``."""
    try:
        provider.release(nodes)
    except Exception as exc:  # noqa: BLE001 - the bootstrap failure is the error to raise
        names = ", ".join(n.name for n in nodes)
        get_run_logger().error("releasing %s after a failed bootstrap failed too: %s", names, exc)
        cause.add_note(f"releasing the nodes ({names}) afterwards failed too: {exc} — release them by hand")


@task(name="host-inventory", **retry_options(retries=3))
def host_inventory(provider: NodeProvider) -> list[Node]:
    """The provider's standing hosts with their GPUs (nvidia-smi), for backends that choose GPUs themselves."""
    nodes = provider.host_inventory()
    if nodes:
        create_table_artifact(key="host-inventory", table=inventory_rows(nodes), description="The provider's hosts")
    return nodes


@task(name="release", **retry_options(retries=5))
def release_nodes(provider: NodeProvider, nodes: list[Node]) -> None:
    provider.release(nodes)


def with_host_gpus(stack: Stack) -> Stack:
    """``stack`` with its Docker hosts' GPU inventories read from the provider's standing hosts (nvidia-smi; nothing
    acquired), so that each GPU request is checked against them before anything is acquired, built or submitted.
    A provider that makes its nodes on demand has none yet: ``Stack.check_gpus`` checks once they are in."""
    if not stack.needs_inventory():
        return stack
    return stack.with_inventory(host_inventory(stack.provider))
