"""Who we are over SSH, kept apart from where we go: one credentials block for ``SlurmCluster`` and ``SshHosts``.

``SshCredentials`` holds the login (user, private key and its passphrase) and the host keys we trust
(``known_hosts``); the blocks that use it hold the settings (hosts, ports, timeouts). One credentials block
can serve a cluster's login node and the GPU hosts that join it. Its client method opens a connection
with the host key checked against ``known_hosts`` only (an unknown or changed key is refused, never added).

Older blocks held these fields flat (``SlurmCluster.user``, ``private_key``, ``private_key_passphrase``,
``known_hosts``; the same on ``SshHosts`` but ``user``). They still load: ``credentials_from_flat`` moves
them into ``credentials`` (a saved block, a stack file, a constructor call). ``credentials`` is the way to
write new ones; giving both is refused, naming the fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import paramiko
from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr

from blocks.errors import ConfigurationError
from blocks.ssh.connection import connect_verified, load_private_key, parse_known_hosts

CREDENTIAL_FIELDS = ("user", "private_key", "private_key_passphrase", "known_hosts")


class SshCredentials(Block):
    """An SSH login (user, private key) and the host keys it trusts."""

    _block_type_name = "gpuferry SSH Credentials"
    _description = (
        "An SSH login: user, private key (and its passphrase) and the known_hosts lines of the hosts it may "
        "reach. Shared by a Slurm cluster's login node and your own SSH hosts."
    )
    # A validation error never echoes its input: the input holds the private key.
    model_config = ConfigDict(hide_input_in_errors=True)

    user: str | None = Field(
        None,
        description="SSH user. Slurm cluster: the user on the login node (the Slurm user the jobs run as); "
        "SSH hosts: the user of every host that does not name its own (none named anywhere: root).",
    )
    private_key: SecretStr | None = Field(
        None, description="SSH private key (OpenSSH or PEM text: Ed25519, ECDSA or RSA); needed to connect."
    )
    private_key_passphrase: SecretStr | None = Field(None, description="Passphrase of the private key, if any.")
    known_hosts: str = Field(
        "",
        description="known_hosts lines of the hosts (`ssh-keyscan -p PORT HOST`, each fingerprint checked); "
        "a host whose key is not here, or differs, is refused.",
    )

    def key(self) -> paramiko.PKey:
        """The private key, decrypted; a clear error naming the field when it is missing or unreadable."""
        if self.private_key is None:
            raise ConfigurationError("credentials.private_key is not set: give the SSH private key (OpenSSH or PEM)")
        return load_private_key(
            self.private_key.get_secret_value(),
            self.private_key_passphrase.get_secret_value() if self.private_key_passphrase else None,
        )

    def host_keys(self) -> paramiko.HostKeys:
        return parse_known_hosts(self.known_hosts)

    def get_client(
        self,
        address: str,
        port: int = 22,
        *,
        user: str | None = None,
        timeout: float = 15.0,
        name: str | None = None,
        check_against: str = "matches the one the host's admins publish",
        key: paramiko.PKey | None = None,
        known: paramiko.HostKeys | None = None,
    ) -> paramiko.SSHClient:
        """A paramiko client logged in to ``address:port`` as ``user`` (default: this block's), the host key
        verified (``blocks/ssh/connection.py`` ``connect_verified``: its errors). ``key``/``known``: already loaded
        (several hosts at once decrypt the key once)."""
        login = user or self.user
        if not login:
            raise ConfigurationError("credentials.user is not set: give the SSH user")
        return connect_verified(
            address=address,
            port=port,
            user=login,
            key=key or self.key(),
            known=known or self.host_keys(),
            timeout=timeout,
            name=name or f"{address}:{port}",
            check_against=check_against,
        )

    @property
    def identity(self) -> tuple[Any, ...]:
        """What a connection opened with these credentials depends on (a copy with others must not reuse it)."""
        return (self.user, self.private_key, self.private_key_passphrase, self.known_hosts)


def credentials_from_flat(data: Any, block: str, flat: Sequence[str] = CREDENTIAL_FIELDS) -> Any:
    """``data`` (a block's input) with its flat credential fields moved into ``credentials``.

    Only fields that are set count (a saved older block holds every field, unset ones as None or "").
    Flat fields next to a ``credentials`` that says otherwise: a ``ConfigurationError`` naming them. (Pydantic
    runs this twice on a block that Prefect loads, the second time on the first's output beside the original
    input: the same values in both places are taken once.)
    """
    if not isinstance(data, dict):
        return data
    given = {name: data[name] for name in flat if name in data and data[name] not in (None, "")}
    rest = {k: v for k, v in data.items() if k not in flat}
    if not given:
        return rest
    credentials = rest.get("credentials")
    if credentials is None:
        return {**rest, "credentials": given}
    current = credentials.model_dump() if isinstance(credentials, SshCredentials) else dict(credentials)
    differ = sorted(name for name, value in given.items() if _plain(value) != _plain(current.get(name)))
    if differ:
        raise ConfigurationError(
            f"{block}: {', '.join(differ)} given both flat and in credentials: set them in credentials only "
            "(the flat fields are the older form)"
        )
    return rest


def _plain(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value
