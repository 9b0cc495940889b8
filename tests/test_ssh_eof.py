"""blocks/_ssh.py's EOF after a command that has already ended: the connection survives it.

paramiko sends a channel's EOF after releasing the channel's lock; if its transport thread answers the server's
CLOSE in that gap, the EOF reaches sshd for a channel it has freed and sshd drops the whole connection. The test
widens that gap on purpose: the EOF waits (up to 3 s) for the channel to be closed before it goes out, against
the slurm stack's real sshd (the cluster's login node)."""

from __future__ import annotations

import time

import paramiko
import pytest

from blocks import _ssh
from tests.stacks import stack_env

pytestmark = pytest.mark.integration


def test_an_eof_for_a_command_that_already_ended_keeps_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    env = stack_env("slurm")
    client = paramiko.SSHClient()
    client.load_host_keys(env["SLURM_KNOWN_HOSTS"])
    client.connect(env["SLURM_SSH_HOST"], port=int(env["SLURM_SSH_PORT"]), username=env["SLURM_SSH_USER"],
                   key_filename=env["SLURM_SSH_KEY"], timeout=30, allow_agent=False, look_for_keys=False)  # fmt: skip
    transport = client.get_transport()
    send = transport._send_user_message
    waited: list[bool] = []

    def eof_after_the_close(message: paramiko.Message) -> None:
        if message.asbytes()[:1] == paramiko.common.cMSG_CHANNEL_EOF:
            channel = next(iter(transport._channels.values()), None)
            deadline = time.monotonic() + 3
            while channel is not None and not channel.closed and time.monotonic() < deadline:
                time.sleep(0.01)
            waited.append(channel is None or channel.closed)  # True: the CLOSE went out before this EOF
        send(message)

    monkeypatch.setattr(transport, "_send_user_message", eof_after_the_close)
    try:
        for _ in range(3):
            assert _ssh.exec_commands(client, ["true"], timeout=60, open_timeout=30) == [(0, "", "")]
        assert waited == [False, False, False]  # the EOF always went out before the channel's CLOSE
        assert transport.is_active()
    finally:
        client.close()
