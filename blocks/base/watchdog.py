"""What ends the wait for a job besides the job's own end: the same rules for ``ComputeBackend.watch`` (a flow
run that polls its job) and the job watcher (``deployments/job_watcher.py``, for suspended flow runs).

* **The time limit, per attempt**: the time the current attempt has been RUNNING, counted from the first poll
  that saw it running. Time pending, preempted or requeued does not count: the next attempt starts afresh. It
  applies only to a backend whose scheduler does not enforce the limit itself (``enforces_time_limit``: Slurm's
  ``--time`` does); the job is cancelled.
* **A lost job**: one the backend has no record of at all (``JobStatus.visible`` False: not queued, not
  running, not in its accounting) for longer than its ``lost_job_grace_seconds`` in a row. A job that was just
  submitted, or that just left the queue before the accounting database caught up, is seen again well within
  the grace; seeing it again starts the grace anew.

Each ``Watchdog`` is fed the statuses of one job, poll after poll, and keeps its clocks in memory: a restarted
watcher starts them again (it waits longer, never less).
"""

from __future__ import annotations

import time
from typing import Protocol

from blocks.errors import JobFailed
from blocks.records import JobHandle, JobStatus


class Watched(Protocol):
    """What a watchdog needs of the job's backend (a ``ComputeBackend``)."""

    @property
    def enforces_time_limit(self) -> bool: ...

    @property
    def lost_job_grace_seconds(self) -> float: ...

    def cancel(self, handle: JobHandle) -> None: ...

    def log_tail(self, handle: JobHandle, lines: int = ...) -> str: ...

    def lost_job(self, handle: JobHandle, unseen_seconds: float) -> JobFailed: ...


class Watchdog:
    """The time limit and the lost-job rule for one job (see the module's docstring)."""

    def __init__(self, backend: Watched, handle: JobHandle, time_limit_seconds: float | None = None) -> None:
        self.backend = backend
        self.handle = handle
        self.time_limit_seconds = time_limit_seconds
        self.running_since: float | None = None  # when the current attempt was first seen running
        self.unseen_since: float | None = None  # when the backend first had no record of the job, in a row

    def check(self, status: JobStatus) -> JobFailed | None:
        """The failure that ends the wait after this (non-terminal) ``status``, or None to keep waiting. A job past
        its time limit is cancelled first; a lost one is cancelled as far as the backend still can."""
        now = time.monotonic()
        if status.state != "RUNNING":
            self.running_since = None
        elif self.running_since is None:
            self.running_since = now
        if status.visible:
            self.unseen_since = None
        elif self.unseen_since is None:
            self.unseen_since = now
        limit = self.time_limit_seconds
        if (
            limit is not None
            and self.running_since is not None
            and not self.backend.enforces_time_limit
            and now - self.running_since > limit
        ):
            self.backend.cancel(self.handle)
            return JobFailed(
                f"job {self.handle.job_id} ran for more than its time limit ({limit:.0f} s, "
                "resources.time_limit_minutes) and was cancelled: raise the limit, or checkpoint more often",
                state="TIMEOUT",
                log_tail=self.backend.log_tail(self.handle),
            )
        if self.unseen_since is not None and now - self.unseen_since > self.backend.lost_job_grace_seconds:
            return self.backend.lost_job(self.handle, now - self.unseen_since)
        return None
