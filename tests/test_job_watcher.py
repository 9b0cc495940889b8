"""The job watcher: which runs it resumes, one batched poll per stack, labels read back (no server), a lost
job failing its run after the grace and a lagging one not; the verdict read back by the resumed train step
(Prefect test server); and a suspended retrain on the real Prefect server and Slurm cluster, resumed by a
real watcher process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blocks.base.compute import ComputeBackend
from blocks.checks import CheckRow, Probe
from blocks.errors import JobFailed
from blocks.records import JobHandle, JobResult, JobStatus, TrainingJob
from blocks.slurm.state import NOT_VISIBLE
from deployments.job_watcher import JOB_LABEL, STACK_LABEL, JobWatcher, Waiting, waiting_from
from tasks.waiting import TIME_LIMIT_LABEL, VERDICT_LABEL, record_verdict, verdict_from
from tests import private_worker
from tests.test_worker_crash import DEADLINE, FINAL, World, log_tail, state_of, world  # noqa: F401 - world: the fixture

REPO = Path(__file__).resolve().parent.parent


def handle(job_id: str) -> JobHandle:
    return JobHandle(
        backend="fake", job_id=job_id, key=job_id, workdir=f"/jobs/{job_id}", log_path=f"/jobs/{job_id}/log"
    )


class FakeCompute:
    def __init__(self, states: dict[str, str], fail: bool = False) -> None:
        self.states, self.fail, self.calls = states, fail, []

    def poll(self, handles: Any) -> dict[str, JobStatus]:
        handles = list(handles)
        self.calls.append([h.job_id for h in handles])
        if self.fail:
            raise ConnectionError("cluster unreachable")
        return {h.job_id: JobStatus(job_id=h.job_id, state=self.states[h.job_id]) for h in handles}


def waiting(job_id: str, stack: str, time_limit_seconds: float | None = None) -> Waiting:
    return Waiting(
        flow_run_id=uuid.uuid4(),
        flow_run_name=f"run-{job_id}",
        stack=stack,
        handle=handle(job_id),
        time_limit_seconds=time_limit_seconds,
    )


def test_resumes_only_runs_whose_job_ended_with_one_poll_per_stack() -> None:
    runs = [waiting("a1", "a"), waiting("a2", "a"), waiting("a3", "a"), waiting("b1", "b"), waiting("e1", "")]
    computes = {
        "a": FakeCompute({"a1": "RUNNING", "a2": "COMPLETED", "a3": "FAILED"}),
        "b": FakeCompute({"b1": "PENDING"}),
        "": FakeCompute({"e1": "REQUEUED"}),
    }
    resumed: list[tuple[str, str]] = []
    watcher = JobWatcher(
        load_compute=computes.__getitem__,
        read=lambda: runs,
        on_ended=lambda w, s: resumed.append((w.handle.job_id, s.state)) or True,
    )
    ended = watcher.poll_once()
    assert sorted(resumed) == [("a2", "COMPLETED"), ("a3", "FAILED")]
    assert sorted(w.handle.job_id for w in ended) == ["a2", "a3"]
    assert computes["a"].calls == [["a1", "a2", "a3"]]  # all of a stack's jobs in one query
    assert computes["b"].calls == [["b1"]] and computes[""].calls == [["e1"]]
    assert watcher.polls == 3


def test_a_failing_stack_does_not_stop_the_others() -> None:
    runs = [waiting("x1", "down"), waiting("y1", "up")]
    computes = {"down": FakeCompute({"x1": "COMPLETED"}, fail=True), "up": FakeCompute({"y1": "COMPLETED"})}
    loads: list[str] = []

    def load(stack: str) -> FakeCompute:
        loads.append(stack)
        return computes[stack]

    resumed: list[str] = []
    watcher = JobWatcher(
        load_compute=load, read=lambda: runs, on_ended=lambda w, s: resumed.append(w.handle.job_id) or True
    )
    watcher.poll_once()
    assert resumed == ["y1"]
    watcher.poll_once()  # the failed stack's backend is loaded afresh; the working one is reused
    assert sorted(loads) == ["down", "down", "up"]
    assert resumed == ["y1", "y1"]  # still suspended in this fake: resumed again, the server refuses the copy


def test_labels_are_the_registry() -> None:
    h = handle("42")
    run = SimpleNamespace(id=uuid.uuid4(), name="r", labels={JOB_LABEL: h.model_dump_json(), STACK_LABEL: "team"})
    w = waiting_from(run)
    assert w is not None and w.handle == h and w.stack == "team" and w.flow_run_id == run.id
    assert w.time_limit_seconds is None
    for limit, read in (("7200.0", 7200.0), ("", None), ("soon", None)):
        run.labels[TIME_LIMIT_LABEL] = limit
        assert waiting_from(run).time_limit_seconds == read  # type: ignore[union-attr]
    assert waiting_from(SimpleNamespace(id=uuid.uuid4(), name="r", labels={"other": "x"})) is None
    assert waiting_from(SimpleNamespace(id=uuid.uuid4(), name="r", labels={JOB_LABEL: "not json"})) is None


UNSEEN = "unseen"


class Timelines(ComputeBackend):
    """Each job's state at each round of the watcher (``round``); UNSEEN: neither queued, running nor accounted."""

    _block_type_name = "Timelines"

    timelines: dict[str, list[str]] = {}
    round: int = 0
    cancelled: list[str] = []

    def validate_job(self, job: TrainingJob) -> None:
        pass

    def submit(self, job: TrainingJob) -> JobHandle:
        return handle(job.key)

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        statuses = {}
        for h in handles:
            timeline = self.timelines[h.job_id]
            step = timeline[min(self.round, len(timeline) - 1)]
            statuses[h.job_id] = (
                JobStatus(job_id=h.job_id, state="PENDING", reason=NOT_VISIBLE, visible=False)
                if step == UNSEEN
                else JobStatus(job_id=h.job_id, state=step)
            )
        return statuses

    def cancel(self, handle: JobHandle) -> None:
        self.cancelled.append(handle.job_id)

    def result(self, handle: JobHandle, status: JobStatus, *, gpus: int = 0, cpus: int = 1) -> JobResult:
        return JobResult(handle=handle, status=status, checkpoint_dir=f"{handle.workdir}/checkpoints")

    def self_check(self, probe: Probe) -> list[CheckRow]:
        probe.skip("checks", "a test double: nothing to reach")
        return probe.rows


def watch_rounds(
    watcher: JobWatcher, backend: Timelines, runs: list[Waiting], clock: list[float], every: float = 10.0
) -> None:
    """Rounds ``every`` (fake) seconds apart until no run waits: a resumed run no longer does (the server's part)."""
    while runs:
        for done in watcher.poll_once():
            runs.remove(done)
        backend.round += 1
        clock[0] += every
        assert clock[0] < 30 * 24 * 3600, f"still waiting after 30 (fake) days: {runs}"


def test_a_lost_job_fails_its_run_after_the_grace_and_a_lagging_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    backend = Timelines(
        timelines={
            "fresh": [UNSEEN] * 30 + ["PENDING"] * 50 + ["RUNNING", "COMPLETED"],  # sacct 300 s behind, then queued
            "flicker": ([UNSEEN] * 40 + ["RUNNING"]) * 2 + ["COMPLETED"],  # unseen 400 s, twice: never 600 s in a row
            "lost": ["RUNNING"] + [UNSEEN],  # the controller lost it
        }
    )
    runs = [waiting(job_id, "hpc") for job_id in backend.timelines]
    resumed: list[tuple[str, str, float]] = []
    failed: list[tuple[str, JobFailed, float]] = []
    watcher = JobWatcher(
        load_compute=lambda stack: backend,
        read=lambda: list(runs),
        on_ended=lambda w, s: resumed.append((w.handle.job_id, s.state, clock[0])) or True,
        on_failed=lambda w, f: failed.append((w.handle.job_id, f, clock[0])) or True,
    )
    watch_rounds(watcher, backend, runs, clock)
    assert [(job, at) for job, _, at in failed] == [("lost", 620.0)]  # unseen from 10 s on: failed past 600 s
    failure = failed[0][1]
    assert (
        failure.state == "FAILED"
        and "job lost is lost: the timelines backend has had no record of it for 610 s (lost_job_grace_seconds=600)"
        in str(failure)
    )
    assert sorted(resumed) == [("flicker", "COMPLETED", 820.0), ("fresh", "COMPLETED", 810.0)]
    assert backend.cancelled == ["lost"]  # in case it shows up again; its secret files go
    assert watcher._watchdogs == {}  # nothing kept for runs that no longer wait


def test_a_long_queue_and_requeues_never_end_a_wait_the_time_limit_counts_per_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A suspended run waits out a 3-day queue and a requeue; only an attempt that runs past its time limit
    ends it, and only where the scheduler does not enforce the limit itself (Slurm's --time does)."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    minute, day = 1, 24 * 60  # rounds: one a minute
    patient = ["PENDING"] * (3 * day) + ["RUNNING"] * 50 + ["REQUEUED"] + ["PENDING"] * day + ["RUNNING"] * 50
    timelines = {"patient": patient + ["COMPLETED"], "overrun": ["PENDING"] * day + ["RUNNING"] * 90 + ["COMPLETED"]}
    for enforced in (False, True):
        backend = type("Backend", (Timelines,), {"enforces_time_limit": enforced, "_block_type_name": f"B{enforced}"})(
            timelines=timelines
        )
        runs = [waiting(job_id, "hpc", time_limit_seconds=3600) for job_id in timelines]
        resumed: list[tuple[str, str, float]] = []
        failed: list[tuple[str, JobFailed, float]] = []
        watcher = JobWatcher(
            load_compute=lambda stack, backend=backend: backend,
            read=lambda runs=runs: list(runs),
            on_ended=lambda w, s, resumed=resumed: resumed.append((w.handle.job_id, s.state, clock[0])) or True,
            on_failed=lambda w, f, failed=failed: failed.append((w.handle.job_id, f, clock[0])) or True,
        )
        clock[0] = 0.0
        watch_rounds(watcher, backend, runs, clock, every=60.0 * minute)
        assert ("patient", "COMPLETED", 60.0 * len(patient)) in resumed  # 4 days and 100 min after it was queued
        if enforced:  # Slurm's --time ends the attempt itself; here the job went on to complete
            assert failed == [] and ("overrun", "COMPLETED", 60.0 * (day + 90)) in resumed and backend.cancelled == []
        else:  # cancelled at the first round past 60 min of running, the queued day not counted
            assert [(job, at) for job, _, at in failed] == [("overrun", 60.0 * (day + 61))]
            assert failed[0][1].state == "TIMEOUT" and "ran for more than its time limit (3600 s" in str(failed[0][1])
            assert backend.cancelled == ["overrun"]


def test_the_verdict_label_is_about_one_job() -> None:
    verdict = '{"job_id": "42", "state": "FAILED", "message": "job 42 is lost: ..."}'
    failure = verdict_from({VERDICT_LABEL: verdict, JOB_LABEL: "..."}, handle("42"))
    assert isinstance(failure, JobFailed) and str(failure) == "job 42 is lost: ..." and failure.state == "FAILED"
    assert verdict_from({VERDICT_LABEL: verdict}, handle("43")) is None  # an earlier job of the run
    assert verdict_from({VERDICT_LABEL: "not json"}, handle("42")) is None and verdict_from(None, handle("42")) is None


@pytest.mark.usefixtures("prefect_server")
def test_the_resumed_train_step_fails_with_the_watchers_verdict() -> None:
    """What the watcher records before it resumes a run whose job it gave up on, read back by the re-executed
    train step through the Prefect API: it fails with it, without waiting again."""
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.train import train_suspending

    backend = Timelines(timelines={"lost-1": ["RUNNING"], "next-1": ["COMPLETED"]})

    @flow(name="verdict-probe")
    def resumed(key: str, verdict_on: str) -> JobResult:
        record_verdict(
            flow_run.get_id(), handle(verdict_on), JobFailed(f"job {verdict_on} is lost: check", state="FAILED")
        )
        return train_suspending(backend, TrainingJob(key=key, workdir=f"/jobs/{key}", command=["true"]), stack="hpc")

    with pytest.raises(JobFailed, match="^job lost-1 is lost: check$"):
        resumed("lost-1", "lost-1")
    # A verdict about an earlier job of the run (a retry submitted a new one) does not fail the new job.
    assert resumed("next-1", "lost-1").status.state == "COMPLETED"


@pytest.mark.usefixtures("prefect_server")
def test_the_suspension_has_no_expiry_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server fails a suspended run whose pause timeout passed: a job queued longer than any bound must not
    meet one. The run suspends without it; the watcher gets the time limit per attempt from the labels."""
    import prefect.flow_runs
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Suspended

    from tasks.train import train_suspending

    asked: list[dict[str, Any]] = []

    class Suspending(Exception):
        pass

    def suspend(**kwargs: Any) -> None:
        asked.append(kwargs)
        raise Suspending  # where the real one ends the run's process

    monkeypatch.setattr(prefect.flow_runs, "suspend_flow_run", suspend)
    backend = Timelines(timelines={"queued-1": ["PENDING"]})

    @flow(name="suspend-probe")
    def long_queue() -> str:
        with contextlib.suppress(Suspending):
            train_suspending(
                backend,
                TrainingJob(key="queued-1", workdir="/jobs/queued-1", command=["true"]),
                stack="hpc",
                timeout_seconds=1800,
            )
        return str(flow_run.get_id())

    run_id = long_queue()
    assert len(asked) == 1 and asked[0]["key"] == "queued-1-0"
    assert Suspended(timeout_seconds=asked[0]["timeout"]).state_details.pause_timeout is None
    with get_client(sync_client=True) as client:
        w = waiting_from(client.read_flow_run(uuid.UUID(run_id)))
    assert w is not None and w.handle.job_id == "queued-1" and w.stack == "hpc" and w.time_limit_seconds == 1800


# ---- against the real Prefect server and Slurm cluster ----------------------------------------------


@pytest.mark.integration
def test_a_suspended_retrain_is_resumed_by_the_watcher_and_completes_with_one_job(world: World) -> None:
    """retrain(wait="suspend"): submit, suspend (no process), the watcher resumes it when the job ends."""
    w = world
    watcher = subprocess.Popen(
        [sys.executable, "-m", "deployments.job_watcher", "--interval", "5"],
        cwd=REPO,
        env=w.env,
        stdout=open(w.tmp / "watcher.log", "wb"),  # noqa: SIM115 - the watcher process owns it
        stderr=subprocess.STDOUT,
    )
    try:
        w.start_worker(f"suspend-{w.uid}")
        with w.client() as client:
            deployment = client.read_deployment_by_name(w.deployment)
            run = client.create_flow_run_from_deployment(
                deployment.id,
                parameters={
                    "stack": w.stack,
                    "wait": "suspend",
                    "training": {
                        "experiment": f"suspend-{w.uid}",
                        "model_name": f"suspend-{w.uid}",
                        "hyperparameters": {"epochs": 3},
                        "resources": {"mem_gb": 2, "gpus_per_node": 1},
                    },
                },
            )
        private_worker.wait_until("the run to end", lambda: state_of(w, run.id) in FINAL, timeout=DEADLINE, interval=2)
        logs = log_tail(w, "suspend") + (w.tmp / "watcher.log").read_text()[-3000:]
        assert state_of(w, run.id) == "COMPLETED", logs
        with w.client() as client:
            history = [s.name for s in client.read_flow_run_states(run.id)]
        assert "Suspended" in history, history
        assert history.index("Suspended") < len(history) - 1 and history[-1] == "Completed", history
        jobs = w.slurm_jobs(f"{run.id}-train")
        assert len(jobs) == 1 and jobs[0][2].startswith("COMPLETED"), jobs
        assert f"of {run.name} ended COMPLETED: resuming it" in (w.tmp / "watcher.log").read_text(), logs
    finally:
        watcher.terminate()
        watcher.wait(60)
