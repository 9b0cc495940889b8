"""Checks of a stack against the systems it names: each backend says what works, what does not, and the fix.

Every block of a stack has a ``self_check(probe)`` method (each step's interface declares it; each backend's checks
sit in its system's folder, next to the client they use: ``blocks/<system>/check.py``). It runs its checks one after
the other through ``probe.step(what, fn, fix)``, which turns each into a ``CheckRow``: ``fn`` returns what it found,
or raises (the row fails with the error and ``fix``), or returns ``Warn(...)``. A check that needs an earlier one
(the Slurm version needs the SSH login) is not run when that one failed. Checks read, or write a probe object and
delete it: nothing is left behind.

``Stack.check`` (``run_groups`` here) runs every backend's checks at once, each group in a thread of its own with
its own deadline: a backend that does not answer gets a failed row for the check it was on ("no answer within N s"),
and the others' rows are not held up. The deadline is for answers: work on this machine that a group does inside
``probe.local()`` (importing a client library) is not counted against it. The Prefect server, its work pool and an
online worker are checked alongside (``deployments/prefect_check.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, Field

from blocks.errors import GpuferryError

Status = Literal["ok", "warn", "failed", "skipped"]
DEFAULT_TIMEOUT_S = 10.0
PROBE_PREFIX = ".gpuferry-check-"  # probe objects and files: written, read back and deleted by a check


class CheckRow(BaseModel):
    """One thing checked: which step and backend, what, how it went, and what to do about a failure."""

    step: str = Field(
        description="The stack's step (provider, images, compute, storage, tracking, serving) or prefect."
    )
    backend: str = Field(description="The block's type, e.g. SlurmCluster.")
    check: str = Field(description="What was checked, e.g. 'SSH host key'.")
    status: Status
    detail: str = Field("", description="What was found (on failure: the error).")
    fix: str = Field("", description="What to change when it failed or warned.")
    seconds: float = Field(0.0, description="How long the check took.")

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass
class Warn:
    """What a check found that works but deserves attention (status ``warn``)."""

    detail: str
    fix: str = ""


class CheckFailed(GpuferryError):
    """A check found something wrong; ``fix`` says what to do (it replaces the step's default fix)."""

    def __init__(self, detail: str, fix: str = "") -> None:
        super().__init__(detail)
        self.fix = fix


class Probe:
    """Runs one backend's checks in order and records them as rows (read while it runs: ``rows``, ``current``)."""

    def __init__(
        self,
        step: str,
        backend: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        needs_image: bool = False,
        probe_id: str | None = None,
        store: Any = None,
    ) -> None:
        self.step_name = step
        self.backend = backend
        self.timeout = timeout
        self.needs_image = needs_image  # the stack builds an image: compute must run containers, serving pull it
        # The stack's checkpoint store: a compute backend whose jobs store their model from the cluster checks that
        # the cluster can (blocks/slurm/check.py). None outside a stack's check.
        self.store: Any = store
        self.probe_id = probe_id or uuid.uuid4().hex[:12]
        self.rows: list[CheckRow] = []
        self.current: str | None = None
        self._started = time.monotonic()
        self._local_s = 0.0  # seconds spent in local(), finished
        self._local_since: float | None = None  # when the local() running now began
        self._lock = threading.Lock()
        self.closed = False  # set when the group ran out of time: later rows are dropped

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Work on this machine (importing a client library): its time does not count against the deadline, which
        is for answers. A busy machine takes seconds to import MLflow, and that is no fault of the server's."""
        started = time.monotonic()
        with self._lock:
            self._local_since = started
        try:
            yield
        finally:
            with self._lock:
                self._local_s += time.monotonic() - started
                self._local_since = None

    def remaining(self) -> float:
        """Seconds left of the deadline (less than 0 past it); the clock stops inside ``local()``."""
        now = time.monotonic()
        with self._lock:
            local = self._local_s + (now - self._local_since if self._local_since is not None else 0.0)
        return self.timeout - (now - self._started - local)

    @property
    def left(self) -> float:
        """Seconds left of the group's deadline (at least 1: a client timeout of 0 means none)."""
        return max(1.0, self.remaining())

    def add(self, check: str, status: Status, detail: str = "", fix: str = "", seconds: float = 0.0) -> CheckRow:
        row = CheckRow(
            step=self.step_name,
            backend=self.backend,
            check=check,
            status=status,
            detail=detail,
            fix=fix if status in ("failed", "warn") else "",
            seconds=round(seconds, 3),
        )
        with self._lock:
            if not self.closed:
                self.rows.append(row)
        return row

    def step(self, check: str, fn: Callable[[], Any], fix: str = "") -> bool:
        """Run ``fn`` as the check ``check``; True when it passed (ok or warn)."""
        self.current = check
        started = time.monotonic()
        try:
            found = fn()
        except CheckFailed as exc:
            self.add(check, "failed", str(exc), exc.fix or fix, time.monotonic() - started)
            return False
        except Exception as exc:  # noqa: BLE001 - a check reports every error as its row
            self.add(check, "failed", _one_line(exc), fix, time.monotonic() - started)
            return False
        finally:
            self.current = None
        if isinstance(found, Warn):
            self.add(check, "warn", found.detail, found.fix or fix, time.monotonic() - started)
        else:
            self.add(check, "ok", "" if found is None else str(found), "", time.monotonic() - started)
        return True

    def info(self, check: str, detail: str) -> None:
        """A row that needs no call (what the block is set to do)."""
        self.add(check, "ok", detail)

    def skip(self, check: str, why: str) -> None:
        self.add(check, "skipped", why)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:600]


def tcp_reach(host: str, port: int, timeout: float) -> str:
    """Open and close a TCP connection to ``host:port``; what answered, or an error naming the address."""
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = (
            "nothing listens there (connection refused)"
            if isinstance(exc, ConnectionRefusedError)
            else f"no answer within {timeout:.0f} s"
            if isinstance(exc, TimeoutError | socket.timeout)
            else str(exc)
        )
        raise CheckFailed(f"{host}:{port}: {reason}") from None
    return f"{host}:{port} answers ({(time.monotonic() - started) * 1000:.0f} ms)"


def writable_dir(path: str) -> str:
    """The nearest existing directory of ``path`` is writable (nothing is created)."""
    target = Path(path).expanduser()
    existing = next((p for p in (target, *target.parents) if p.exists()), None)
    if existing is None or not os.access(existing if existing.is_dir() else existing.parent, os.W_OK):
        raise CheckFailed(f"{existing or target} is not writable")
    return f"{target} ({'exists' if target.exists() else 'created on first use'})"


def executable(name: str) -> str:
    """The path of the program ``name`` (a path, or a name on PATH)."""
    import shutil

    found = shutil.which(name)
    if found is None:
        raise CheckFailed(f"{name}: no such executable here")
    return found


# ---- the whole stack, at once ------------------------------------------------------------------------


def _group(probe: Probe, run: Callable[[Probe], Any]) -> threading.Thread:
    def target() -> None:
        try:
            run(probe)
        except Exception as exc:  # noqa: BLE001 - a check that crashed is a failed row, not a crashed command
            probe.add(probe.current or "check", "failed", _one_line(exc), "this is a bug in the check: report it")

    # The caller's context (Prefect's settings, e.g. its API URL) goes with the thread.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name=f"check-{probe.step_name}", daemon=True)
    thread.start()
    return thread


def run_groups(groups: Iterable[tuple[Probe, Callable[[Probe], Any]]]) -> list[CheckRow]:
    """Run each ``(probe, checks)`` group in a thread of its own; the rows, in the groups' order.

    A group still running at its probe's deadline gets a failed row for the check it was on (or
    "no answer within N s" after its last row), and whatever it records later is dropped.
    """
    groups = list(groups)
    threads = [_group(probe, run) for probe, run in groups]
    out: list[CheckRow] = []
    for (probe, _), thread in zip(groups, threads, strict=True):
        while thread.is_alive() and (left := probe.remaining()) > 0:
            thread.join(min(left, 0.25))  # the deadline moves while the group works locally: look again soon
        if thread.is_alive():
            with probe._lock:
                probe.closed = True
                current = probe.current or "next check"
                rows = list(probe.rows)
            rows.append(
                CheckRow(
                    step=probe.step_name,
                    backend=probe.backend,
                    check=current,
                    status="failed",
                    detail=f"no answer within {probe.timeout:.0f} s",
                    seconds=round(probe.timeout, 3),
                    fix=f"{probe.backend} does not answer: is it up and reachable from here (firewall, VPN, address)? "
                    "`gpuferry check --timeout` waits longer",
                )
            )
        else:
            rows = list(probe.rows)
        out.extend(rows)
    return out


def reach_url(probe: Probe, url: str, fix: str) -> bool:
    """The row ``reach``: a TCP connection to the host and port of ``url`` (``fix`` when it fails)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return probe.step("reach", lambda: tcp_reach(parsed.hostname or "", port, probe.left), fix)
