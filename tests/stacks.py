"""Connection settings of the local stacks that `make <stack>-up` starts (scripts/<stack>.sh)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest


def stacks_root() -> Path:
    default = Path(os.environ.get("GPUFERRY_CACHE", Path.home() / ".cache" / "gpuferry")) / "stacks"
    return Path(os.environ.get("GPUFERRY_STACKS", default))


def stack_env(name: str) -> dict[str, str]:
    """The KEY=VALUE lines `scripts/<name>.sh up` wrote, or skip/fail when the stack is not up.

    Under `make test` (GPUFERRY_REQUIRE_STACKS=1) a missing stack fails the test: `make test`
    starts every stack, so a missing one is a bug, not a reason to skip.
    """
    path = stacks_root() / name / "env"
    if not path.exists():
        message = f"the {name} stack is not up: run `make {name}-up` ({path} missing)"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


class Relay:
    """TCP relay from ``listen_host``:<free port> to ``target`` (host, port), one thread per connection."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((listen_host, 0))
        self.address = self.server.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=30)
            except OSError:
                client.close()
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def host_address() -> str:
    """This machine's address on its default route: containers on podman's bridge reach the host there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # a UDP "connect" only picks the route; nothing is sent
        return s.getsockname()[0]
