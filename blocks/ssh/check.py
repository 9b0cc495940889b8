"""The SSH rows every block that logs in over SSH reports in ``gpuferry check``: the port answers, the host key is
the one in known_hosts, the user logs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blocks.checks import Probe, tcp_reach
from blocks.errors import ConfigurationError

if TYPE_CHECKING:
    import paramiko

    from blocks.ssh.credentials import SshCredentials


def ssh_rows(
    probe: Probe,
    *,
    host: str | None,
    port: int,
    credentials: SshCredentials | None,
    user: str | None = None,
    label: str = "",
) -> paramiko.SSHClient | None:
    """The rows SSH reach, host key and login of one host; the logged-in client, or None when one failed.
    ``user``: the host's own (default: the credentials')."""
    from blocks.ssh.connection import fingerprint

    prefix = f"{label} " if label else ""
    user = user or (credentials.user if credentials is not None else None)
    key_text = credentials.private_key if credentials is not None else None
    if not host or not user or not key_text or credentials is None:
        missing = [
            n for n, v in (("host", host), ("credentials.user", user), ("credentials.private_key", key_text)) if not v
        ]
        probe.add(f"{prefix}SSH", "failed", f"{', '.join(missing)} not set", "set them in the stack file")
        return None
    if not probe.step(
        f"{prefix}SSH reach",
        lambda: tcp_reach(host, port, probe.left),
        "check host and port, and that this machine may reach the login node (VPN, firewall)",
    ):
        return None
    login_fix = f"check user and private_key, and that the public key is in ~{user}/.ssh/authorized_keys"
    try:
        key = credentials.key()
    except ConfigurationError as exc:
        probe.add(f"{prefix}SSH login", "failed", str(exc), login_fix)
        return None
    client: list[Any] = []
    refused: list[str] = []

    def host_key() -> str:
        try:
            client.append(
                credentials.get_client(
                    host,
                    port,
                    user=user,
                    key=key,
                    timeout=probe.left,
                    name=f"{host}:{port}",
                    check_against="matches the one the admins publish",
                )
            )
        except ConfigurationError as exc:
            if "SSH login as" not in str(exc):
                raise
            refused.append(str(exc))  # paramiko checks the host key before it authenticates: the key was fine
            return "matches known_hosts"
        remote = client[0].get_transport().get_remote_server_key()
        return f"{remote.get_name()} {fingerprint(remote)} matches known_hosts"

    keyscan = f"ssh-keyscan -p {port} {host}"
    if not probe.step(
        f"{prefix}SSH host key",
        host_key,
        f"compare `{keyscan}` with the fingerprint the admins publish, then put its line in known_hosts",
    ):
        return None
    if refused:
        probe.add(f"{prefix}SSH login", "failed", refused[0], login_fix)
        return None
    probe.add(f"{prefix}SSH login", "ok", f"logged in as {user}")
    return client[0]
