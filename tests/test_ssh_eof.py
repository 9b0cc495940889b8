"""blocks/ssh/connection.py's EOF that ends a command's stdin, against the slurm stack's real sshd (the cluster's
login node).

paramiko sends a channel's EOF after releasing the channel's lock; if its transport thread answers the server's
CLOSE in that gap, the EOF reaches sshd for a channel it has freed and sshd drops the whole connection. The first
test widens that gap on purpose: the EOF waits (up to 3 s) for the channel to be closed before it goes out. The
second starts an EOF while a key exchange is on: it must wait for the exchange without the channel's lock, which
the transport thread may need to finish it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import paramiko
import pytest

from blocks.ssh import connection as _ssh
from tests.stacks import stack_env

pytestmark = pytest.mark.integration


@pytest.fixture
def client() -> Iterator[paramiko.SSHClient]:
    env = stack_env("slurm")
    client = paramiko.SSHClient()
    client.load_host_keys(env["SLURM_KNOWN_HOSTS"])
    client.connect(
        env["SLURM_SSH_HOST"],
        port=int(env["SLURM_SSH_PORT"]),
        username=env["SLURM_SSH_USER"],
        key_filename=env["SLURM_SSH_KEY"],
        timeout=30,
        allow_agent=False,
        look_for_keys=False,
    )
    try:
        yield client
    finally:
        client.close()


def test_an_eof_for_a_command_that_already_ended_keeps_the_connection(
    client: paramiko.SSHClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = client.get_transport()
    send = transport._send_message
    waited: list[bool] = []

    def eof_after_the_close(message: paramiko.Message) -> None:
        if message.asbytes()[:1] == paramiko.common.cMSG_CHANNEL_EOF:
            channel = next(iter(transport._channels.values()), None)
            deadline = time.monotonic() + 3
            while channel is not None and not channel.closed and time.monotonic() < deadline:
                time.sleep(0.01)
            waited.append(channel is None or channel.closed)  # True: the CLOSE went out before this EOF
        send(message)

    monkeypatch.setattr(transport, "_send_message", eof_after_the_close)
    for _ in range(3):
        assert _ssh.exec_commands(client, ["true"], timeout=60, open_timeout=30) == [(0, "", "")]
    assert waited == [False, False, False]  # the EOF always went out before the channel's CLOSE
    assert transport.is_active()


def test_an_eof_waits_for_a_key_exchange_without_holding_the_channels_lock(client: paramiko.SSHClient) -> None:
    transport = client.get_transport()
    chan = transport.open_session(timeout=30)
    chan.settimeout(60)
    chan.exec_command("cat")  # ends at its stdin's EOF
    with transport.clear_to_send_lock:
        transport.clear_to_send.clear()  # what paramiko does when a key exchange starts
    sent = threading.Event()
    threading.Thread(target=lambda: (_ssh.shutdown_write(chan), sent.set()), daemon=True).start()
    try:
        assert not sent.wait(1.0), "the EOF went out during the key exchange"
        assert chan.lock.acquire(timeout=10), "the EOF waits for the key exchange holding the channel's lock"
        chan.lock.release()
    finally:
        with transport.clear_to_send_lock:
            transport.clear_to_send.set()  # the exchange is over
    assert sent.wait(30), "the EOF did not go out after the key exchange"
    assert _ssh._collect(chan, 60, time.monotonic() + 60) == (0, "", "")  # cat got its EOF and exited
    assert transport.is_active()
