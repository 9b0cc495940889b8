"""The provision and release flows on the embedded stack (this machine as the one node)."""

from __future__ import annotations

import socket

import pytest

from blocks.base.provider import NodeRequirements
from blocks.errors import ConfigurationError
from flows.provision import provision, release

pytestmark = pytest.mark.usefixtures("prefect_server")


def test_provision_returns_the_checked_inventory_and_release_takes_it_back() -> None:
    nodes = provision(count=1, requirements=NodeRequirements(gpus=0), key="test-provision")
    assert [n.name for n in nodes] == [socket.gethostname()]
    assert nodes[0].state == "ready" and nodes[0].cpus >= 1 and nodes[0].labels["run"] == "test-provision"
    assert release(nodes=nodes) is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: provision(count=0), "count=0"),
        (lambda: provision(count=2), "resources.nodes=2"),  # the local machine is one node
        (lambda: provision(count=1, requirements=NodeRequirements(gpus=64)), "gpu"),
        (lambda: release(nodes=[]), "nodes is empty"),
    ],
)
def test_bad_requests_fail_naming_what_to_change(call, message: str) -> None:
    with pytest.raises(Exception) as info:
        call()
    assert message.lower() in str(info.value).lower()
    if message != "gpu":
        assert isinstance(info.value, ConfigurationError)
