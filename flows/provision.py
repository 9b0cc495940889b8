"""Provision nodes on their own, and give them back: for work that outlives one pipeline run.

``provision`` acquires ``count`` nodes from the stack's provider, bootstraps and checks them, and
returns the inventory (also a table artifact); ``release`` gives nodes back. Acquiring again with the
same ``key`` reuses the nodes, and releasing twice is harmless, so both are safe to retry.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from blocks.base.provider import NodeRequirements
from blocks.errors import ConfigurationError
from blocks.records import Node
from blocks.stack import Stack, load_stack
from tasks.provision import provision_nodes, release_nodes


@flow(name="provision", log_prints=True)
def provision(
    count: int = 1,
    requirements: NodeRequirements = NodeRequirements(),
    stack: Stack | str | None = None,
    key: str | None = None,
) -> list[Node]:
    """Acquire, bootstrap and check ``count`` nodes; return them (give them to ``release`` when done).

    Args:
        count: how many nodes.
        requirements: what each node must offer (GPUs, GPU memory, driver version).
        stack: a saved ``Stack`` block, or its name, whose provider hands out the nodes (empty: embedded).
        key: what the nodes are acquired for (a second run with the same key gets the same nodes);
            empty: this flow run's id.
    """
    if count < 1:
        raise ConfigurationError(f"count={count}: give the number of nodes, at least 1")
    blocks = load_stack(stack)
    return provision_nodes(blocks.provider, count, requirements, key or f"{flow_run.get_id() or 'local'}")


@flow(name="release", log_prints=True)
def release(nodes: list[Node], stack: Stack | str | None = None) -> None:
    """Give ``nodes`` back to the stack's provider (the inventory ``provision`` returned).

    Args:
        nodes: the nodes to release.
        stack: the saved ``Stack`` block they were provisioned with, or its name (empty: embedded).
    """
    if not nodes:
        raise ConfigurationError("nodes is empty: give the nodes the provision flow returned")
    blocks = load_stack(stack)
    release_nodes(blocks.provider, nodes)
