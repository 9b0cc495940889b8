"""blocks/ssh/connection.py's connect: a port that accepts connections but never speaks SSH is a clear timeout."""

from __future__ import annotations

import socket
import threading
import time

import paramiko
import pytest

from blocks.ssh.connection import connect_verified


def test_a_port_that_sends_no_banner_is_a_timeout_naming_the_host() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])  # accepted, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    port = server.getsockname()[1]
    try:
        started = time.monotonic()
        expected = rf"login\.example: no SSH answer within 1 s .*sshd listening on {port}"
        with pytest.raises(TimeoutError, match=expected):
            connect_verified(
                address="127.0.0.1",
                port=port,
                user="u",
                key=paramiko.RSAKey.generate(1024),
                known=paramiko.HostKeys(),
                timeout=1.0,
                name="login.example",
                check_against="-",
            )
        assert time.monotonic() - started < 30
    finally:
        server.close()
        for conn in held:
            conn.close()
