"""ComputeBackend.watch, whatever the backend: it polls through a passing outage (TransientError) for
up to outage_tolerance_seconds, and gives up with a transient error after that; its time limit counts the
time an attempt runs, not time in the queue or requeued."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from blocks.compute import ComputeBackend
from blocks.errors import ConfigurationError, JobFailed, TransientError
from blocks.specs import JobHandle, JobStatus, TrainingJob

HANDLE = JobHandle(backend="scripted", job_id="7", key="k", workdir="/nonexistent", log_path="/nonexistent/log")


class Scripted(ComputeBackend):
    """Each poll takes the next step: a state name, or an exception to raise."""

    steps: list = []
    polls: int = 0
    cancelled: int = 0

    def validate_job(self, job: TrainingJob) -> None:
        pass

    def submit(self, job: TrainingJob) -> JobHandle:
        return HANDLE

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        step = self.steps[min(self.polls, len(self.steps) - 1)]
        self.polls += 1
        if isinstance(step, BaseException):
            raise step
        return {h.job_id: JobStatus(job_id=h.job_id, state=step) for h in handles}

    def cancel(self, handle: JobHandle) -> None:
        self.cancelled += 1


def scripted(steps: list, tolerance: float) -> Scripted:
    return Scripted(steps=steps, outage_tolerance_seconds=tolerance, poll_interval_start=0.01, poll_interval_max=0.02)


def test_watch_polls_through_a_passing_outage() -> None:
    outage = TransientError("controller down")
    backend = scripted(["RUNNING", outage, outage, outage, "RUNNING", "COMPLETED"], tolerance=60)
    assert backend.watch(HANDLE).state == "COMPLETED"
    assert backend.polls == 6


def test_watch_gives_up_after_the_tolerated_outage() -> None:
    backend = scripted(["RUNNING", TransientError("controller down")], tolerance=0.2)
    with pytest.raises(TransientError, match="did not answer for .*outage_tolerance_seconds=0.*controller down"):
        backend.watch(HANDLE)
    assert backend.polls > 2  # it did try again before giving up


def test_watch_raises_other_errors_at_once() -> None:
    backend = scripted(["RUNNING", ConfigurationError("bad"), "COMPLETED"], tolerance=60)
    with pytest.raises(ConfigurationError, match="bad"):
        backend.watch(HANDLE)
    assert backend.polls == 2


def test_time_in_the_queue_or_requeued_does_not_count_against_the_time_limit() -> None:
    import time

    class Clocked(Scripted):
        """Each poll moves a fake clock on by 10 s."""

        def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
            clock[0] += 10.0
            return super().poll(handles)

    clock = [0.0]
    real = time.monotonic
    time.monotonic = lambda: clock[0]  # type: ignore[assignment]
    try:
        # 100 s pending, 20 s running, requeued, 100 s pending, 20 s running: never 30 s in one attempt.
        steps = ["PENDING"] * 10 + ["RUNNING"] * 2 + ["REQUEUED"] + ["PENDING"] * 10 + ["RUNNING"] * 2 + ["COMPLETED"]
        backend = Clocked(steps=steps, poll_interval_start=0.001, poll_interval_max=0.001)
        assert backend.watch(HANDLE, timeout_seconds=30).state == "COMPLETED" and backend.cancelled == 0
        # An attempt that runs 40 s is cancelled, naming the limit.
        late = Clocked(steps=["PENDING"] * 5 + ["RUNNING"] * 5 + ["COMPLETED"], poll_interval_start=0.001,
                       poll_interval_max=0.001)  # fmt: skip
        with pytest.raises(JobFailed, match="ran for more than its time limit .*time_limit_minutes") as failed:
            late.watch(HANDLE, timeout_seconds=30)
        assert failed.value.state == "TIMEOUT" and late.cancelled == 1
        # A scheduler that enforces the limit itself (Slurm's --time) is left to do so.
        enforced = type("Enforced", (Clocked,), {"enforces_time_limit": True})(
            steps=["RUNNING"] * 6 + ["TIMEOUT"], poll_interval_start=0.001, poll_interval_max=0.001)
        assert enforced.watch(HANDLE, timeout_seconds=30).state == "TIMEOUT" and enforced.cancelled == 0
    finally:
        time.monotonic = real  # type: ignore[assignment]
