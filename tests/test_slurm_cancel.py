"""Cancelling a flow run through the Prefect API, or with `gpuferry cancel`, cancels its Slurm job.

The flow is served by a real Prefect runner (a subprocess, as in production); cancelling the run sets
it Cancelling, the runner's observer sees that and stops the flow's process with SIGTERM, the waiting
train task gets TerminationSignal and scancels the job.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import LogSort
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from blocks.slurm.cluster import SlurmCluster
from tests import private_worker
from tests.processes import stop_process_group
from tests.test_slurm_cluster import REPO, cluster, env, wait_for  # noqa: F401 - fixtures
from tests.test_worker_crash import DEADLINE, World, log_tail, world  # noqa: F401 - world: the fixture

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

FLOW = textwrap.dedent("""
    from pathlib import Path

    from prefect import flow
    from prefect.runtime import flow_run

    from blocks.slurm.cluster import SlurmCluster
    from blocks.records import TrainingJob
    from blocks.specs import Resources
    from blocks.workload.source import code_archive
    from tasks.train import train


    @flow(name="slurm-cancel-probe")
    def long_job(block: str) -> None:
        compute = SlurmCluster.load(block)
        key = f"{flow_run.get_id()}-train"
        code = code_archive(Path(__file__).resolve().parent / "code")
        train(compute, TrainingJob(key=key, workdir=compute.job_workdir(key), command=["bash", "long.sh"], code=code,
                                   resources=Resources(time_limit_minutes=10)))


    if __name__ == "__main__":
        long_job.serve(name="cancel-probe", limit=1)
""")

# Stands in for a long training run (the job's command, shipped with its code).
LONG = 'for i in $(seq 1 600); do echo "tick $i"; sleep 1; done\n'


def test_cancelling_the_flow_run_cancels_the_slurm_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "serve_probe.py").write_text(FLOW)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "long.sh").write_text(LONG)
    block = cluster
    block.save("slurm-cancel-probe", overwrite=True)

    runner_env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": str(REPO),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    log = open(tmp_path / "runner.log", "wb")  # noqa: SIM115 - closed below
    runner = subprocess.Popen(
        [sys.executable, "serve_probe.py"],
        cwd=tmp_path,
        env=runner_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with get_client(sync_client=True) as client:

            def deployed() -> bool:
                assert runner.poll() is None, (tmp_path / "runner.log").read_text()[-3000:]
                try:
                    client.read_deployment_by_name("slurm-cancel-probe/cancel-probe")
                    return True
                except Exception:  # noqa: BLE001 - not registered yet
                    return False

            wait_for(deployed, 180, "the served deployment")
            run = run_deployment(
                "slurm-cancel-probe/cancel-probe", parameters={"block": "slurm-cancel-probe"}, timeout=0
            )
            key = f"{run.id}-train"
            job_id = wait_for(lambda: cluster.find_job(key), 180, "the flow's Slurm job")
            handle = cluster._handle(str(job_id), key, cluster.job_workdir(key), f"{cluster.job_workdir(key)}/job.log")
            wait_for(lambda: "tick 2" in cluster.read_log(handle)[0], 120, "the job running")

            client.set_flow_run_state(run.id, Cancelling(message="cancelled by the test"))

            wait_for(lambda: cluster.poll([handle])[handle.job_id].state == "CANCELLED", 120, "the job cancelled")
            wait_for(lambda: client.read_flow_run(run.id).state.is_cancelled(), 120, "the flow run Cancelled")
            ticks = cluster.read_log(handle)[0].count("tick ")
            assert ticks < 300  # stopped long before its end
            # The run's own logs (a session's server holds many), shipped by the runner in the background.
            run_logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
            wait_for(
                lambda: any(
                    f"cancelling job {job_id}" in entry.message
                    for entry in client.read_logs(log_filter=run_logs, limit=200, sort=LogSort.TIMESTAMP_DESC)
                ),
                60,
                "the run's log of the cancelled job",
            )
    finally:
        stop_process_group(runner, signal.SIGINT, 60)  # SIGINT first: the runner's own cancellation path
        log.close()


def test_gpuferry_cancel_ends_a_running_and_a_suspended_retrain_and_their_jobs(world: World) -> None:
    """`gpuferry cancel` (the installed tool) on two retrains of the Slurm stack: one running in the worker's
    process (wait=block) and one suspended while its job runs (wait=suspend: no process, no watcher). Both end
    Cancelled with their jobs CANCELLED and nothing left in the queue; `gpuferry logs` shows the job's own lines."""
    w = world
    w.start_worker(f"cancel-{w.uid}")
    training = {
        "experiment": f"cancel-{w.uid}",
        "model_name": f"cancel-{w.uid}",
        "hyperparameters": {"epochs": 10000},  # far longer than the test: only a cancel ends it
        "resources": {"mem_gb": 2, "gpus_per_node": 1},
    }
    with w.client() as client:
        deployment = client.read_deployment_by_name(w.deployment)
        runs = {
            wait: client.create_flow_run_from_deployment(
                deployment.id, parameters={"stack": w.stack, "wait": wait, "training": training}
            )
            for wait in ("block", "suspend")
        }

    def state_name(wait: str) -> str:
        with w.client() as client:
            state = client.read_flow_run(runs[wait].id).state
        return state.name if state else ""

    def job(wait: str) -> list[str]:
        jobs = w.slurm_jobs(f"{runs[wait].id}-train")
        return jobs[0] if len(jobs) == 1 else ["", "", ""]

    def logged(wait: str) -> str:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        with w.client() as client:
            entries = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[wait].id])), limit=200)
        return "\n".join(e.message for e in entries)

    def ready() -> bool:
        assert state_name("block") not in ("Failed", "Crashed", "Completed"), log_tail(w, "cancel")
        assert state_name("suspend") not in ("Failed", "Crashed", "Completed"), log_tail(w, "cancel")
        return (
            state_name("suspend") == "Suspended"
            and job("suspend")[2] in ("RUNNING", "PENDING")
            and job("block")[2] == "RUNNING"
            and "training 10000 epochs" in logged("block")  # the job's own line, forwarded into the run's log
        )

    private_worker.wait_until("a running and a suspended run, with their jobs", ready, timeout=DEADLINE, interval=2)
    jobs = {wait: job(wait)[0] for wait in runs}
    gpuferry = [str(REPO / ".venv/bin/gpuferry")]
    for wait, run in runs.items():
        done = subprocess.run([*gpuferry, "cancel", run.name], env=w.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{run.name}: {'Cancelling' if wait == 'block' else 'Cancelled'}" in done.stdout, done.stdout
        assert f"cancelled its training job {jobs[wait]} on " in done.stdout, done.stdout

    def ended(wait: str) -> bool:
        return state_name(wait) == "Cancelled" and job(wait)[2].startswith("CANCELLED")

    for wait in runs:
        private_worker.wait_until(f"the {wait} run and its job Cancelled", functools.partial(ended, wait), 300)
        live = subprocess.run(
            ["squeue", "-h", "-n", f"{runs[wait].id}-train"],
            env={"SLURM_CONF": w.slurm["SLURM_CONF"], "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert not live.strip(), live  # nothing pending, running or suspended
    shown = subprocess.run(
        [*gpuferry, "logs", runs["block"].name], env=w.env, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    assert f"[job {jobs['block']}] training 10000 epochs" in shown.stdout, shown.stdout[-3000:]
