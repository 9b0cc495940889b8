"""Processes the tests start in a session of their own (``start_new_session=True``), stopped with what they forked."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, first: signal.Signals = signal.SIGTERM, grace_s: float = 30) -> None:
    """``first`` (SIGTERM) to ``proc``'s process group, SIGKILL after ``grace_s``; then SIGKILL to whatever of the
    group is left (children a stopped server or relay forked)."""
    if proc.poll() is None:
        os.killpg(proc.pid, first)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
