"""Controller outages on the real local Slurm: slurmctld stopped (SIGTERM) and started again with the
stack script's own command line (`scripts/slurm.sh stop-controller|start-controller`)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest
from prefect import get_client

from blocks.errors import TransientError
from blocks.records import TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources
from tasks.train import train
from tests.examples import JOBS, code_of
from tests.test_slurm_cluster import REPO, cluster, env, jobs_named, key, slurm, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


def controller(action: str) -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm.sh"), f"{action}-controller"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr


def record_failures(cluster: SlurmCluster, method: str) -> threading.Event:
    """An event set once ``cluster.<method>`` has raised a TransientError (the outage was seen)."""
    failed = threading.Event()
    original: Callable[..., Any] = getattr(cluster, method)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except TransientError:
            failed.set()
            raise

    object.__setattr__(cluster, method, wrapped)
    return failed


class Drill(threading.Thread):
    """Stop the controller once ``ready`` holds (None: it is already stopped); start it again once
    ``seen`` is set."""

    def __init__(self, ready: Callable[[], bool] | None, seen: threading.Event) -> None:
        super().__init__(daemon=True)
        self.ready, self.seen, self.error = ready, seen, None

    def run(self) -> None:
        try:
            if self.ready is not None:
                wait_for(self.ready, 180, "the moment to stop the controller")
                controller("stop")
            assert self.seen.wait(180), "nobody noticed that the controller was down"
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            controller("start")


@pytest.fixture
def watcher(cluster: SlurmCluster) -> SlurmCluster:
    return cluster.model_copy()


def test_job_survives_a_controller_restart_while_watched(watcher: SlurmCluster, env: dict[str, str]) -> None:
    k = key("ctld")
    handle = watcher.submit_command(k, ["bash", "-c", "for i in $(seq 1 15); do echo tick $i; sleep 1; done"])
    outage_seen = record_failures(watcher, "poll")
    drill = Drill(lambda: "tick 2" in watcher.read_log(handle)[0], outage_seen)
    drill.start()
    status = watcher.watch(handle, timeout_seconds=300)  # polls through the outage
    drill.join(200)
    assert drill.error is None, drill.error
    assert outage_seen.is_set()  # watch really polled a stopped controller, and carried on
    assert status.state == "COMPLETED", status
    assert watcher.read_log(handle)[0].split("\n")[:-1] == [f"tick {i}" for i in range(1, 16)]  # ran once, whole
    assert jobs_named(env, k) == [handle.job_id]
    wait_for(
        lambda: (
            slurm(env, "sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id, "--format=State").split() == ["COMPLETED"]
        ),
        60,
        "one COMPLETED attempt in sacct",
    )


@pytest.mark.usefixtures("prefect_server")
def test_submit_is_retried_until_the_controller_is_back(watcher: SlurmCluster, env: dict[str, str]) -> None:
    # `true`: a job that succeeds at once (this is about the submit, not training).
    compute = watcher.model_copy()
    k = key("down")
    job = TrainingJob(
        key=k,
        workdir=compute.job_workdir(k),
        command=["true"],
        code=code_of(JOBS),
        resources=Resources(time_limit_minutes=5),
    )
    submit_failed = record_failures(compute, "run")
    controller("stop")
    drill = Drill(None, submit_failed)  # starts it again once a submit has failed on it
    drill.start()
    state = train.with_options(retries=20, retry_delay_seconds=1, retry_jitter_factor=0)(
        compute, job, timeout_seconds=240, return_state=True
    )
    drill.join(200)
    assert drill.error is None, drill.error
    assert state.is_completed(), state
    result = state.result()
    assert result.status.state == "COMPLETED"
    with get_client(sync_client=True) as client:
        run = client.read_task_run(state.state_details.task_run_id)
    assert run.run_count >= 2  # the first attempt failed on the stopped controller and was retried
    wait_for(lambda: jobs_named(env, k), 60, "the job in Slurm")
    assert jobs_named(env, k) == [result.handle.job_id]  # exactly one job
