"""A worker killed mid-flow, with its flow-run process (the machine died): the run is marked Crashed,
and retrying it adopts the Slurm job the first attempt submitted instead of submitting a second one.

Real Prefect server (scripts/prefect.sh) and Slurm cluster (scripts/slurm.sh). The test has its own
work pool, worker (deployments/worker.py, in a session of its own so its whole process group can be
killed) and copy of the `weekly` retrain deployment; deployments/crashed_runs.py's automation,
limited to that deployment, marks the run Crashed once its heartbeats stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import private_worker
from tests.stacks import stack_env
from tests.test_pipeline_slurm import slurm_stack

pytestmark = pytest.mark.integration

HEARTBEAT_S = 30  # Prefect's minimum interval
CRASH_AFTER_S = 90  # no heartbeat for this long: crashed
DEADLINE = 900.0  # seconds: a whole retrain on a busy 2-core machine


class World:
    def __init__(self, tmp: Path) -> None:
        self.prefect = stack_env("prefect")
        self.slurm = stack_env("slurm")
        self.api_url = self.prefect["PREFECT_API_URL"]
        self.uid = uuid.uuid4().hex[:8]
        self.tmp = tmp
        self.pool = f"gpuferry-crash-{self.uid}"
        self.stack = f"gpuferry-crash-{self.uid}"
        self.deployment = ""
        self.automation = f"gpuferry-crash-test-{self.uid}"
        self.env = private_worker.worker_env(self.api_url, tmp / "home")
        self.env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(HEARTBEAT_S)
        self.workers: list[subprocess.Popen[bytes]] = []

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        proc = private_worker.start_worker(self.pool, name, self.env, self.tmp / f"{name}.log", new_session=True)
        self.workers.append(proc)
        return proc

    def slurm_jobs(self, key: str) -> list[list[str]]:
        """Every job named ``key`` that Slurm knows: the live ones (squeue) and the finished ones (sacct)."""
        env = {"SLURM_CONF": self.slurm["SLURM_CONF"], "PATH": "/usr/bin:/bin"}
        live = subprocess.run(
            ["squeue", "-h", "-n", key, "-o", "%i|%j|%T"], env=env, capture_output=True, text=True, check=True
        ).stdout
        done = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-S", "now-2hours", f"--name={key}", "-o", "JobID,JobName,State"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        jobs = {line.split("|")[0]: line.split("|") for line in (done + live).splitlines() if line.strip()}
        return sorted(jobs.values())


def save_stack(w: World) -> None:
    from blocks.local.serving import LocalServing

    stack = slurm_stack("worker-crash")  # training on the Slurm stack as a remote cluster, over SSH
    stack.serving = LocalServing(state_dir=str(w.tmp / "serving"), drain_seconds=2)
    stack.save(w.stack, overwrite=True)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    w = World(tmp_path)
    with temporary_settings({PREFECT_API_URL: w.api_url}):
        names = private_worker.render(tmp_path / "prefect.yaml", ["weekly"], w.pool, w.uid)
        w.deployment = names["weekly"]
        private_worker.deploy(tmp_path / "prefect.yaml", w.env, w.pool)
        save_stack(w)
        try:
            yield w
        finally:
            for proc in w.workers:
                kill_group(proc, signal.SIGTERM)
            from prefect.automations import Automation

            from blocks.local.serving import LocalServing

            LocalServing(state_dir=str(tmp_path / "serving")).undeploy("digits")
            with contextlib.suppress(ValueError):
                Automation.read(name=w.automation).delete()
            private_worker.remove(w.api_url, [w.deployment], w.pool)
            with w.client() as client:
                from blocks.stack import Stack

                client.delete_block_document(
                    client.read_block_document_by_name(w.stack, Stack.get_block_type_slug()).id
                )


def kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the worker's whole session: the worker and the flow-run process it started."""
    if proc.poll() is None or sig == signal.SIGKILL:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_killed_worker_crashes_the_run_and_the_retry_adopts_the_slurm_job(world: World) -> None:
    from prefect.states import AwaitingRetry

    from deployments import crashed_runs

    w = world
    with w.client() as client:
        deployment = client.read_deployment_by_name(w.deployment)
    crashed_runs.ensure(name=w.automation, within_s=CRASH_AFTER_S, deployment_ids=[str(deployment.id)])
    first = w.start_worker(f"crash-a-{w.uid}")
    with w.client() as client:
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "stack": w.stack,
                "training": {
                    "experiment": f"crash-{w.uid}",
                    "model_name": f"crash-{w.uid}",
                    "hyperparameters": {"epochs": 3},
                    "resources": {"mem_gb": 2, "gpus_per_node": 1},
                },
            },
        )
    key = f"{run.id}-train"

    # Mid-flow: the training job is in Slurm. Kill the worker and the run's process at once.
    private_worker.wait_until(
        "the run's Slurm job", lambda: w.slurm_jobs(key) or state_of(w, run.id) in FINAL, timeout=DEADLINE, interval=1
    )
    assert w.slurm_jobs(key), f"the run ended ({state_of(w, run.id)}) before submitting: {log_tail(w, 'crash-a')}"
    assert state_of(w, run.id) == "RUNNING"
    kill_group(first, signal.SIGKILL)

    private_worker.wait_until(
        "the run to be marked crashed",
        lambda: state_of(w, run.id) != "RUNNING",
        timeout=CRASH_AFTER_S + 600,
        interval=2,
    )
    assert state_of(w, run.id) == "CRASHED"

    # Retry it, as the UI's Retry does; a new worker picks it up (same flow run id, same job key).
    with w.client() as client:
        client.set_flow_run_state(run.id, AwaitingRetry(message="retry after the worker died"), force=True)
    w.start_worker(f"crash-b-{w.uid}")
    private_worker.wait_until(
        "the retried run to end", lambda: state_of(w, run.id) in FINAL, timeout=DEADLINE, interval=2
    )
    assert state_of(w, run.id) == "COMPLETED", log_tail(w, "crash-b")
    jobs = w.slurm_jobs(key)
    assert len(jobs) == 1, f"one Slurm job expected for {key}, Slurm has: {jobs}"
    assert jobs[0][2].startswith("COMPLETED"), jobs
    with w.client() as client:
        history = [s.type.value for s in client.read_flow_run_states(run.id)]
    assert "CRASHED" in history and history[-1] == "COMPLETED", history


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def state_of(w: World, run_id: Any) -> str:
    with w.client() as client:
        state = client.read_flow_run(run_id).state
    return state.type.value if state else ""


def log_tail(w: World, prefix: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in w.tmp.glob(f"{prefix}*.log"))
