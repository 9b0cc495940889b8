"""SshCredentials: one SSH login block for SlurmCluster and SshHosts; the older flat fields still load into it.

The secret (a private key's text) is planted and looked for in every repr, error and log line these paths make.
The saved-block test writes a block document in the older flat form on the session's Prefect test server and
loads it back through the block class, as a block saved before credentials existed is loaded.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from blocks.base.provider import NodeRequirements, NodesUnreachable
from blocks.errors import ConfigurationError
from blocks.hosts.provider import SshHost, SshHosts
from blocks.slurm.cluster import SlurmCluster
from blocks.ssh.credentials import SshCredentials

PLANTED = "-----BEGIN OPENSSH PRIVATE KEY-----\nplanted-c2VjcmV0LWtleS10ZXh0\n-----END OPENSSH PRIVATE KEY-----"
MARK = "planted-c2VjcmV0LWtleS10ZXh0"


def test_the_older_flat_fields_of_slurm_cluster_land_in_credentials() -> None:
    cluster = SlurmCluster(
        host="login.example",
        user="alice",
        private_key=SecretStr(PLANTED),
        private_key_passphrase="pw-planted",
        known_hosts="login.example ssh-ed25519 AAAA\n",
    )
    assert cluster.credentials == SshCredentials(
        user="alice",
        private_key=PLANTED,
        private_key_passphrase="pw-planted",
        known_hosts="login.example ssh-ed25519 AAAA\n",
    )
    assert cluster.user == "alice"
    dumped = cluster.model_dump()
    assert not {"user", "private_key", "private_key_passphrase", "known_hosts"} & set(dumped)  # not kept as extras
    # A block saved before credentials existed holds every flat field, the unset ones as None or "".
    local = SlurmCluster(local=True, user=None, private_key=None, private_key_passphrase=None, known_hosts="")
    assert local.credentials is None


def test_the_older_flat_fields_of_ssh_hosts_land_in_credentials_and_hosts_keep_their_users() -> None:
    hosts = SshHosts(
        hosts=[SshHost(address="10.0.0.1"), SshHost(address="10.0.0.2", user="ubuntu")],
        private_key=PLANTED,
        known_hosts="",
    )
    assert hosts.credentials.private_key is not None and hosts.credentials.private_key.get_secret_value() == PLANTED
    assert [hosts.user_of(h) for h in hosts.hosts] == ["root", "ubuntu"]
    shared = SshCredentials(user="gpu", private_key=PLANTED)
    assert [SshHosts(hosts=hosts.hosts, credentials=shared).user_of(h) for h in hosts.hosts] == ["gpu", "ubuntu"]
    with pytest.raises(ValidationError, match=r"credentials\.private_key is required"):
        SshHosts(hosts=hosts.hosts, credentials=SshCredentials(user="gpu"))


@pytest.mark.parametrize("block", ["SlurmCluster", "SshHosts"])
def test_both_forms_at_once_are_refused_naming_the_fields_and_never_echoing_the_key(block: str) -> None:
    credentials = SshCredentials(user="alice", private_key=PLANTED)
    with pytest.raises(ValidationError) as err:
        if block == "SlurmCluster":
            SlurmCluster(host="h", credentials=credentials, private_key=PLANTED + "2", known_hosts="h ssh-ed25519 AAAA")
        else:
            SshHosts(
                hosts=[SshHost(address="10.0.0.1")],
                credentials=credentials,
                private_key=PLANTED + "2",
                known_hosts="h ssh-ed25519 AAAA",
            )
    message = str(err.value)
    assert (
        f"{block}: known_hosts, private_key given both flat and in credentials: set them in credentials only" in message
    )
    assert MARK not in message and MARK not in repr(err.value)  # what a log or a traceback shows
    # The same value in both places says nothing different: it is taken once.
    same = SlurmCluster(host="h", credentials=credentials, private_key=PLANTED, user="alice")
    assert same.credentials == credentials


def test_the_key_never_shows_in_a_repr_or_a_validation_error() -> None:
    credentials = SshCredentials(user="alice", private_key=PLANTED, private_key_passphrase="pw-planted")
    cluster = SlurmCluster(host="h", credentials=credentials)
    for text in (repr(credentials), str(credentials), repr(cluster), str(cluster.model_dump())):
        assert MARK not in text and "pw-planted" not in text
    with pytest.raises(ValidationError) as err:  # a bad field next to the key: the error names the field only
        SlurmCluster(host="h", port=70000, user="alice", private_key=PLANTED)
    assert "port" in str(err.value) and MARK not in str(err.value)


def test_an_unreadable_key_is_a_clear_error_without_the_key() -> None:
    with pytest.raises(ConfigurationError, match="private_key is not an OpenSSH/PEM private key") as err:
        SshCredentials(user="alice", private_key=PLANTED).key()
    assert MARK not in str(err.value)
    with pytest.raises(ConfigurationError, match=r"credentials\.private_key is not set"):
        SshCredentials(user="alice").key()
    with pytest.raises(ConfigurationError, match="host and credentials .* are required unless local=True"):
        SlurmCluster(host="h").run(["true"])


def test_connection_retries_log_the_host_never_the_key(caplog: pytest.LogCaptureFixture) -> None:
    """A real ed25519 key and a port nothing listens on: the retries are logged, the key is not."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/k"], check=True)
        text = Path(f"{tmp}/k").read_text()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    hosts = SshHosts(
        hosts=[SshHost(address="127.0.0.1", port=port, name="gone")],
        credentials=SshCredentials(private_key=text),
        connect_attempts=2,
        retry_backoff_seconds=0,
        connect_timeout=2,
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(NodesUnreachable) as err:
        hosts.inspect(hosts.acquire(1, NodeRequirements(), "r"))
    body = text.splitlines()[1]
    assert "gone: connection attempt 1/2 failed" in caplog.text
    assert body not in caplog.text and body not in str(err.value)


@pytest.mark.usefixtures("prefect_server")
def test_a_block_saved_in_the_older_flat_form_loads_with_credentials() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import BlockDocumentCreate

    name = f"flat-{uuid.uuid4().hex[:8]}"
    flat = {
        "host": "login.example",
        "port": 2222,
        "user": "alice",
        "private_key": PLANTED,
        "private_key_passphrase": None,
        "known_hosts": "[login.example]:2222 ssh-ed25519 AAAA\n",
        "local": False,
    }
    SlurmCluster.register_type_and_schema()
    with get_client(sync_client=True) as client:
        block_type = client.read_block_type_by_slug(SlurmCluster.get_block_type_slug())
        schema = client.get_most_recent_block_schema_for_block_type(block_type.id)
        assert schema is not None
        client.create_block_document(
            BlockDocumentCreate(name=name, data=flat, block_type_id=block_type.id, block_schema_id=schema.id)
        )
    loaded = SlurmCluster.load(name)
    assert loaded.port == 2222 and loaded.user == "alice"
    assert loaded.credentials is not None and loaded.credentials.private_key.get_secret_value() == PLANTED
    assert loaded.credentials.known_hosts == "[login.example]:2222 ssh-ed25519 AAAA\n"
    loaded.save(name, overwrite=True)  # saved again: in the new form, and it loads the same
    again = SlurmCluster.load(name).credentials
    assert again is not None and again.private_key is not None
    assert (again.user, again.private_key.get_secret_value(), again.known_hosts) == (
        "alice",
        PLANTED,
        loaded.credentials.known_hosts,
    )
