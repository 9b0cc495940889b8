"""The job watcher: which runs it resumes, one batched poll per stack, labels read back (no server); and a
suspended retrain on the real Prefect server and Slurm cluster, resumed by a real watcher process."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blocks.specs import JobHandle, JobStatus
from deployments.job_watcher import JOB_LABEL, STACK_LABEL, JobWatcher, Waiting, waiting_from
from tests import private_worker
from tests.test_worker_crash import DEADLINE, FINAL, World, log_tail, state_of, world  # noqa: F401 - world: the fixture

REPO = Path(__file__).resolve().parent.parent


def handle(job_id: str) -> JobHandle:
    return JobHandle(backend="fake", job_id=job_id, key=job_id, workdir=f"/jobs/{job_id}", log_path=f"/jobs/{job_id}/log")


class FakeCompute:
    def __init__(self, states: dict[str, str], fail: bool = False) -> None:
        self.states, self.fail, self.calls = states, fail, []

    def poll(self, handles: Any) -> dict[str, JobStatus]:
        handles = list(handles)
        self.calls.append([h.job_id for h in handles])
        if self.fail:
            raise ConnectionError("cluster unreachable")
        return {h.job_id: JobStatus(job_id=h.job_id, state=self.states[h.job_id]) for h in handles}


def waiting(job_id: str, stack: str) -> Waiting:
    return Waiting(flow_run_id=uuid.uuid4(), flow_run_name=f"run-{job_id}", stack=stack, handle=handle(job_id))


def test_resumes_only_runs_whose_job_ended_with_one_poll_per_stack() -> None:
    runs = [waiting("a1", "a"), waiting("a2", "a"), waiting("a3", "a"), waiting("b1", "b"), waiting("e1", "")]
    computes = {
        "a": FakeCompute({"a1": "RUNNING", "a2": "COMPLETED", "a3": "FAILED"}),
        "b": FakeCompute({"b1": "PENDING"}),
        "": FakeCompute({"e1": "REQUEUED"}),
    }
    resumed: list[tuple[str, str]] = []
    watcher = JobWatcher(load_compute=computes.__getitem__, read=lambda: runs,
                         on_ended=lambda w, s: resumed.append((w.handle.job_id, s.state)) or True)  # fmt: skip
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
    watcher = JobWatcher(load_compute=load, read=lambda: runs, on_ended=lambda w, s: resumed.append(w.handle.job_id) or True)
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
    assert waiting_from(SimpleNamespace(id=uuid.uuid4(), name="r", labels={"other": "x"})) is None
    assert waiting_from(SimpleNamespace(id=uuid.uuid4(), name="r", labels={JOB_LABEL: "not json"})) is None


# ---- against the real Prefect server and Slurm cluster ----------------------------------------------


@pytest.mark.integration
def test_a_suspended_retrain_is_resumed_by_the_watcher_and_completes_with_one_job(world: World) -> None:
    """retrain(wait="suspend"): submit, suspend (no process), the watcher resumes it when the job ends."""
    w = world
    watcher = subprocess.Popen([sys.executable, "-m", "deployments.job_watcher", "--interval", "5"], cwd=REPO, env=w.env,
                               stdout=open(w.tmp / "watcher.log", "wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        w.start_worker(f"suspend-{w.uid}")
        with w.client() as client:
            deployment = client.read_deployment_by_name(w.deployment)
            run = client.create_flow_run_from_deployment(deployment.id, parameters={
                "stack": w.stack, "wait": "suspend",
                "training": {"experiment": f"suspend-{w.uid}", "model_name": f"suspend-{w.uid}",
                             "hyperparameters": {"epochs": 3}, "resources": {"mem_gb": 2, "gpus_per_node": 1}},
            })  # fmt: skip
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
