"""ComputeBackend.watch, whatever the backend: it polls through a passing outage (TransientError) for
up to outage_tolerance_seconds, and gives up with a transient error after that; its time limit counts the
time an attempt runs, not time in the queue or requeued; a job the backend has no record of fails as lost
only after lost_job_grace_seconds in a row."""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest

from blocks.base.compute import ComputeBackend
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, JobFailed, TransientError
from blocks.records import JobHandle, JobStatus, TrainingJob
from blocks.slurm.state import NOT_VISIBLE

UNSEEN = "unseen"
HANDLE = JobHandle(backend="scripted", job_id="7", key="k", workdir="/nonexistent", log_path="/nonexistent/log")


class Scripted(ComputeBackend):
    """Each poll takes the next step: a state name, or an exception to raise."""

    _block_type_name = "Scripted"

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
        if step == UNSEEN:  # what SlurmCluster answers for a job neither squeue nor sacct has
            return {
                h.job_id: JobStatus(job_id=h.job_id, state="PENDING", reason=NOT_VISIBLE, visible=False)
                for h in handles
            }
        return {h.job_id: JobStatus(job_id=h.job_id, state=step) for h in handles}

    def cancel(self, handle: JobHandle) -> None:
        self.cancelled += 1

    def self_check(self, probe: Probe) -> list[CheckRow]:
        probe.skip("checks", "a test double: nothing to reach")
        return probe.rows


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


class Clocked(Scripted):
    """Each poll moves the fake clock (the ``clock`` fixture) on by 10 s."""

    _block_type_name = "Clocked"

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        CLOCK[0] += 10.0
        assert CLOCK[0] < 4 * 3600, "still watching after four (fake) hours"
        return super().poll(handles)


CLOCK = [0.0]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """time.monotonic as a fake clock that only the polls of ``Clocked`` move."""
    CLOCK[0] = 0.0
    monkeypatch.setattr(time, "monotonic", lambda: CLOCK[0])
    return CLOCK


def clocked(steps: list, **fields: object) -> Clocked:
    return Clocked(steps=steps, poll_interval_start=0.001, poll_interval_max=0.001, **fields)


@pytest.mark.usefixtures("clock")
def test_time_in_the_queue_or_requeued_does_not_count_against_the_time_limit() -> None:
    # 100 s pending, 20 s running, requeued, 100 s pending, 20 s running: never 30 s in one attempt.
    steps = ["PENDING"] * 10 + ["RUNNING"] * 2 + ["REQUEUED"] + ["PENDING"] * 10 + ["RUNNING"] * 2 + ["COMPLETED"]
    backend = clocked(steps)
    assert backend.watch(HANDLE, timeout_seconds=30).state == "COMPLETED" and backend.cancelled == 0
    # An attempt that runs 40 s is cancelled, naming the limit.
    late = clocked(["PENDING"] * 5 + ["RUNNING"] * 5 + ["COMPLETED"])
    with pytest.raises(JobFailed, match="ran for more than its time limit .*time_limit_minutes") as failed:
        late.watch(HANDLE, timeout_seconds=30)
    assert failed.value.state == "TIMEOUT" and late.cancelled == 1
    # A scheduler that enforces the limit itself (Slurm's --time) is left to do so.
    enforced = type("Enforced", (Clocked,), {"enforces_time_limit": True, "_block_type_name": "Enforced"})(
        steps=["RUNNING"] * 6 + ["TIMEOUT"], poll_interval_start=0.001, poll_interval_max=0.001
    )
    assert enforced.watch(HANDLE, timeout_seconds=30).state == "TIMEOUT" and enforced.cancelled == 0


@pytest.mark.usefixtures("clock")
def test_a_job_the_accounting_has_not_caught_up_with_is_not_lost() -> None:
    """sacct lags: a job that is briefly in neither squeue nor sacct is waited for, and each time it is seen
    again the grace starts anew (800 s unseen in all, never 600 s in a row)."""
    steps = [UNSEEN] * 40 + ["PENDING", "RUNNING"] + [UNSEEN] * 40 + ["RUNNING", "COMPLETED"]
    backend = clocked(steps)
    assert backend.lost_job_grace_seconds == 600  # the default
    assert backend.watch(HANDLE).state == "COMPLETED"
    assert backend.cancelled == 0 and backend.polls == len(steps)


def test_a_job_the_backend_lost_fails_after_the_grace(clock: list[float]) -> None:
    backend = clocked(["PENDING", "RUNNING"] + [UNSEEN])
    with pytest.raises(
        JobFailed,
        match=r"job 7 is lost: the clocked backend has had no record of it for 610 s "
        r"\(lost_job_grace_seconds=600\), neither queued, running nor finished\. "
        r"Check .*Then run it again: the job is submitted afresh\.",
    ) as lost:
        backend.watch(HANDLE, timeout_seconds=30)
    assert lost.value.state == "FAILED"
    assert clock[0] == 640  # seen at 10 and 20 s, unseen from 30 s: lost at the first poll past 600 s
    assert backend.cancelled == 1  # in case it shows up again (and its secrets go)
    shorter = clocked([UNSEEN], lost_job_grace_seconds=60)
    with pytest.raises(JobFailed, match=r"no record of it for 70 s \(lost_job_grace_seconds=60\)"):
        shorter.watch(HANDLE)


def test_a_lost_slurm_job_says_what_to_check() -> None:
    from blocks.slurm.cluster import SlurmCluster

    commands: list[list[str]] = []
    cluster = SlurmCluster(local=True)
    object.__setattr__(cluster, "run", lambda argv, **kw: commands.append(list(argv)) or (0, "", ""))
    handle = HANDLE.model_copy(update={"workdir": "/shared/jobs/k", "log_path": "/shared/jobs/k/job.log"})
    failure = cluster.lost_job(handle, 612.4)
    text = str(failure)
    assert "job 7 is lost: the gpuferry-slurm-cluster backend has had no record of it for 612 s" in text
    assert "Neither squeue nor sacct knows job 7 (k): the controller lost its state" in text
    assert "`sacct -D -j 7`" in text and "/shared/jobs/k/job.log" in text
    assert commands[0] == ["scancel", "7"] and commands[1][:3] == ["rm", "-f", "--"]  # its secret files go


def test_each_change_of_state_is_heard_once_with_its_reason() -> None:
    """on_state hears PENDING, then RUNNING, then the end: once per change of state or reason, not per poll; a poll
    the backend has no record for is not a change."""

    class Reasons(Scripted):
        def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
            step = self.steps[min(self.polls, len(self.steps) - 1)]
            self.polls += 1
            if step == UNSEEN:
                return {
                    h.job_id: JobStatus(job_id=h.job_id, state="PENDING", reason=NOT_VISIBLE, visible=False)
                    for h in handles
                }
            state, reason, nodes = step
            return {h.job_id: JobStatus(job_id=h.job_id, state=state, reason=reason, nodes=nodes) for h in handles}

    backend = Reasons(
        steps=[
            UNSEEN,
            ("PENDING", "Slurm reason: Priority", ""),
            ("PENDING", "Slurm reason: Priority", ""),
            ("PENDING", "Slurm reason: Resources", ""),
            ("RUNNING", "", "n1,n2"),
            ("RUNNING", "", "n1,n2"),
            ("COMPLETED", "", ""),
        ],
        poll_interval_start=0.01,
        poll_interval_max=0.02,
    )
    heard: list[JobStatus] = []
    assert backend.watch(HANDLE, on_state=heard.append).state == "COMPLETED"
    assert [s.summary() for s in heard] == [
        "PENDING (Slurm reason: Priority)",
        "PENDING (Slurm reason: Resources)",
        "RUNNING on n1,n2",
        "COMPLETED",
    ]
