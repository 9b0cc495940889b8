"""Sweeps without Slurm: a grid on the embedded stack runs as a local job array (blocks/base/arrays.py), a child
MLflow run per configuration, as many at once as asked (or as the machine has room for), the best promoted.

The regressor's alpha x l1_ratio, as tests/test_slurm_sweep.py runs it on Slurm: the same flow, the same records."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from blocks.local.compute import LocalProcesses
from blocks.records import TrainingJob
from blocks.specs import Resources, ServingSpec, SweepGrid, TrainingSpec
from blocks.stack import Stack
from flows.sweep import sweep
from tests.examples import DIABETES, code_of

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("prefect_server")]


def test_a_sweep_runs_as_a_local_job_array_and_ships_the_best() -> None:
    service = f"sweep-local-{uuid.uuid4().hex[:6]}"
    grid = SweepGrid(values={"alpha": [0.001, 1.0, 30.0], "l1_ratio": [0.2, 0.9]})
    outcome = sweep(
        workload=str(DIABETES),
        grid=grid,
        training=TrainingSpec(model_name=f"diabetes-sweep-{uuid.uuid4().hex[:6]}"),
        serving=ServingSpec(service_name=service),
        parallelism=2,
    )
    stack = Stack.embedded()
    try:
        client = stack.tracking.client
        assert outcome.completed == 6 and outcome.failed == 0
        children = [client.get_run(r) for r in outcome.child_run_ids]
        configs = [json.loads(c.data.tags["gpuferry.hparams"]) for c in children]
        assert sorted((c["alpha"], c["l1_ratio"]) for c in configs) == sorted(
            (a, r) for a in (0.001, 1.0, 30.0) for r in (0.2, 0.9)
        )
        rmse = [c.data.metrics["val_rmse"] for c in children]
        assert outcome.best_index == rmse.index(min(rmse))  # the workload's direction: minimise
        assert outcome.pipeline.model_version.run_id == outcome.child_run_ids[outcome.best_index]
        assert outcome.pipeline.deployed and stack.serving.current(service) is not None
        # One array: its record in the sweep's directory, each task a job of its own beside it.
        key = f"{client.get_run(outcome.parent_run_id).data.tags['prefect.flow_run_id']}-sweep"
        workdir = Path(stack.compute.job_workdir(key))
        array = json.loads((workdir / "array.json").read_text())
        assert array["size"] == 6 and array["parallelism"] == 2 and len(array["slots"]) == 6
        assert sorted(p.name for p in workdir.glob("task-*")) == [f"task-{i}" for i in range(6)]
    finally:
        stack.serving.undeploy(service)


def test_no_more_tasks_run_at_once_than_the_parallelism(tmp_path: Path) -> None:
    """Three tasks, two at a time: each task records when it ran; no three intervals overlap, and each task got
    its own settings. A released task starts on a poll of the array; all of them end COMPLETED."""
    compute = LocalProcesses(workdir_root=str(tmp_path / "jobs"), poll_interval_start=0.1, poll_interval_max=0.3)
    program = (
        "import json, os, time; start = time.time(); time.sleep(1.5); "
        "open(os.path.join(os.path.dirname(os.environ['CHECKPOINT_DIR']), 'ran.json'), 'w').write("
        "json.dumps([os.environ['TASK'], start, time.time()]))"
    )
    job = TrainingJob(
        key="sweep-par",
        workdir=compute.job_workdir("sweep-par"),
        command=["python", "-c", program],
        resources=Resources(),
        code=code_of(DIABETES),
    )
    handle = compute.submit_held_sweep(job, 3, parallelism=2)
    assert compute.poll([handle])[handle.job_id].state == "PENDING"  # held: nothing runs before its release
    compute.release_sweep_tasks(handle, {i: {"TASK": f"t{i}"} for i in range(3)}, whole_array=True)
    started = time.monotonic()
    status = compute.watch(handle)
    assert status.state == "COMPLETED", status
    outcome = compute.array_outcome(handle, 3)
    assert [outcome[i][0].state for i in range(3)] == ["COMPLETED"] * 3
    ran = [json.loads((Path(compute.task_dir(handle.workdir, i)) / "ran.json").read_text()) for i in range(3)]
    assert [r[0] for r in ran] == ["t0", "t1", "t2"]
    for moment in (r[1] for r in ran):  # at any task's start, at most two tasks were running
        assert sum(1 for _, a, b in ran if a <= moment < b) <= 2, ran
    assert time.monotonic() - started >= 3.0  # three tasks of 1.5 s, two at a time: two rounds
    assert compute.submit_held_sweep(job, 3, parallelism=2).job_id == handle.job_id  # a retry adopts it
