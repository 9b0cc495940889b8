"""One SSH connection to one host, the way every block here talks to a machine over SSH.

``SshSession`` opens its connection on first use (``SshCredentials.get_client``: the host key checked
against known_hosts), reuses it for every command and the SFTP channel, and opens it again when it
dropped. Commands are argv lists joined with ``shlex.quote``, several at once one channel each.
Failures come out as they are (``ConfigurationError`` for a refused host key or login; ``OSError`` /
``EOFError`` / ``paramiko.SSHException`` for a connection that failed), after the connection is closed,
for the block to retry or word them: ``SlurmCluster`` (``blocks/slurm/transport.py``) keeps one session to the
login node, ``SshHosts`` (``blocks/hosts/provider.py``) one per host while it works on it.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Sequence

import paramiko

from blocks.ssh.connection import exec_commands
from blocks.ssh.credentials import SshCredentials

TRANSPORT_ERRORS = (OSError, EOFError, paramiko.SSHException)


class SshSession:
    """A reused, verified connection to ``address:port`` (see the module's docstring)."""

    def __init__(
        self,
        credentials: SshCredentials,
        address: str,
        port: int = 22,
        *,
        user: str | None = None,
        connect_timeout: float = 15.0,
        command_timeout: float = 120.0,
        name: str | None = None,
        check_against: str = "matches the one the host's admins publish",
        key: paramiko.PKey | None = None,
        known: paramiko.HostKeys | None = None,
    ) -> None:
        self.credentials, self.address, self.port = credentials, address, port
        self.user = user or credentials.user
        self.connect_timeout, self.command_timeout = connect_timeout, command_timeout
        self.name = name or f"{address}:{port}"
        self.check_against = check_against
        self._key, self._known = key, known
        self._lock = threading.RLock()
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None

    def adopt(self, client: paramiko.SSHClient) -> SshSession:
        """Use ``client`` (already connected and verified) as this session's connection."""
        with self._lock:
            self.close()
            self._client = client
        return self

    def client(self) -> paramiko.SSHClient:
        """The connection, opened (again) when there is none or it dropped."""
        with self._lock:
            transport = self._client.get_transport() if self._client is not None else None
            if transport is None or not transport.is_active():
                self.close()
                self._client = self.credentials.get_client(
                    self.address,
                    self.port,
                    user=self.user,
                    timeout=self.connect_timeout,
                    name=self.name,
                    check_against=self.check_against,
                    key=self._key,
                    known=self._known,
                )
            return self._client

    def sftp(self) -> paramiko.SFTPClient:
        """An SFTP channel over the connection (reused while the connection lives)."""
        with self._lock:
            client = self.client()
            channel = self._sftp.get_channel() if self._sftp is not None else None
            if channel is None or channel.get_transport() is not client.get_transport():
                self._sftp = client.open_sftp()
            return self._sftp

    def run(
        self, argv: Sequence[str] | str, *, timeout: float | None = None, stdin: bytes | None = None
    ) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of one command: an argv list, or a shell string already quoted."""
        return self.run_all([argv], timeout=timeout, stdin=stdin)[0]

    def run_all(
        self, argvs: Sequence[Sequence[str] | str], *, timeout: float | None = None, stdin: bytes | None = None
    ) -> list[tuple[int, str, str]]:
        """Several commands at once, one SSH channel each (login shells can be slow to start); ``stdin`` is
        written to each. A failed connection is closed (the next command opens a new one) and re-raised."""
        commands = [a if isinstance(a, str) else shlex.join(a) for a in argvs]
        try:
            return exec_commands(
                self.client(),
                commands,
                timeout=timeout or self.command_timeout,
                open_timeout=self.connect_timeout,
                stdin=stdin,
            )
        except TRANSPORT_ERRORS:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection (the next command opens a new one)."""
        with self._lock:
            for closable in (self._sftp, self._client):
                try:
                    if closable is not None:
                        closable.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
            self._sftp = self._client = None
