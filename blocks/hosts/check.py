"""The checks of your own hosts (``SshHosts.self_check``): SSH reach, host key and login of every host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blocks.checks import Probe
from blocks.ssh.check import ssh_rows

if TYPE_CHECKING:
    from blocks.hosts.provider import SshHosts


def check_ssh_hosts(hosts: SshHosts, probe: Probe) -> None:
    """SSH reach, host key and login of every host (in order: each has the rest of the deadline)."""
    for host in hosts.hosts:
        client = ssh_rows(
            probe,
            host=host.address,
            port=host.port,
            credentials=hosts.credentials,
            user=hosts.user_of(host),
            label=host.node_name,
        )
        if client is not None:
            client.close()
