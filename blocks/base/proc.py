"""Processes on this machine, named by pid *and* start time (pids are reused)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, started: str | None) -> bool:
    """True while the process that had this pid and start time runs (a zombie counts as dead)."""
    _reap(pid)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == started and fields[0] != "Z"


def stop(pid: int, started: str | None, grace_seconds: float = 30.0) -> bool:
    """SIGTERM, wait up to ``grace_seconds`` for a graceful exit, then SIGKILL. True if it was running."""
    if not alive(pid, started):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not alive(pid, started):
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    while alive(pid, started):
        time.sleep(0.05)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
