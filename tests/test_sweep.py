"""The sweep's grid (validated before anything runs) and its refusal on a backend without job arrays."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks.errors import ConfigurationError
from blocks.specs import SweepGrid
from blocks.workload.hparams import HyperparameterSchema

SCHEMA = HyperparameterSchema(
    {
        "type": "object",
        "properties": {
            "lr": {"type": "number", "exclusiveMinimum": 0, "default": 0.05},
            "hidden": {"type": "integer", "minimum": 1, "default": 128},
            "seed": {"type": "integer", "minimum": 0, "default": 0},
            "optimizer": {"enum": ["sgd", "adam"], "default": "sgd"},
        },
    }
)


def expand(grid: SweepGrid, **base: object) -> list[dict]:
    return SCHEMA.expand_grid(SCHEMA.validate(base), grid.values, grid.configurations)


def test_grid_is_the_cartesian_product_on_the_base() -> None:
    grid = SweepGrid(values={"lr": [0.1, 0.01], "hidden": [16, 32, 64]}, configurations=[{"optimizer": "adam"}])
    assert grid.size == 7
    configs = expand(grid, seed=3)
    assert [(c["lr"], c["hidden"]) for c in configs[:6]] == [
        (0.1, 16),
        (0.1, 32),
        (0.1, 64),
        (0.01, 16),
        (0.01, 32),
        (0.01, 64),
    ]
    assert configs[6] == {"lr": 0.05, "hidden": 128, "seed": 3, "optimizer": "adam"}
    assert all(c["seed"] == 3 for c in configs)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"values": {"lr": []}}, r"values\['lr'\] is empty"),
        ({"values": {"lr": [0.1, 0.1]}}, r"values\['lr'\] lists a value twice"),
        ({}, "the sweep is empty"),
        (
            {"values": {"lr": [0.1, 0.2], "seed": list(range(6))}, "max_configurations": 10},
            "12 configurations, more than max_configurations=10",
        ),
    ],
)
def test_bad_grids_are_refused_naming_the_field(grid: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SweepGrid(**grid)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (
            {"values": {"learning_rate": [0.1]}},
            r"grid: 'learning_rate' is not a declared hyperparameter of the workload; valid: lr, hidden, seed",
        ),
        ({"values": {"lr": [0.1, -1.0]}}, r"(?s)configuration 1 \{'lr': -1.0\}.*hyperparameters.lr"),
        ({"configurations": [{"optimizer": "rmsprop"}]}, r"(?s)configuration 0 .*hyperparameters.optimizer"),
        ({"configurations": [{"depth": 3}]}, r"grid: 'depth' is not a declared hyperparameter"),
    ],
)
def test_grids_are_checked_against_the_workloads_schema(grid: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        expand(SweepGrid(**grid))


def test_a_backend_without_job_arrays_names_those_that_have_them() -> None:
    """Every bundled compute backend runs sweeps (Slurm's arrays; arrays of local processes or of containers); one
    that does not says which do, and that retrain trains one configuration at a time."""
    from blocks.docker.compute import DockerCompute
    from blocks.local.compute import LocalProcesses
    from blocks.slurm.cluster import SlurmCluster

    assert LocalProcesses.supports_arrays and DockerCompute.supports_arrays and SlurmCluster.supports_arrays

    class Plain(LocalProcesses):
        supports_arrays = False

    message = str(Plain().no_arrays())
    assert "SlurmCluster, LocalProcesses, DockerCompute" in message and "`retrain`" in message, message


class HeldArray:
    """A job array backend that records what the sweep task asks of it (no cluster)."""

    backend_name = "held-array"
    supports_arrays = True

    def __init__(self) -> None:
        self.released: dict[int, dict[str, str]] = {}
        self.releases: list[list[int]] = []
        self.whole_released = False
        self.submits = 0

    def submit_held_sweep(self, job, size, *, parallelism=None):  # type: ignore[no-untyped-def]
        from blocks.records import JobHandle

        self.submits += 1
        self.size = size
        return JobHandle(backend="held-array", job_id="42", key=job.key, workdir=job.workdir, log_path="/dev/null")

    def release_sweep_tasks(self, handle, tasks, *, whole_array=False):  # type: ignore[no-untyped-def]
        assert not self.whole_released, "released after the whole array"
        assert not set(tasks) & set(self.released), "a task was released twice"
        if whole_array:  # every task still held runs now: each must have its settings
            assert sorted({*self.released, *tasks}) == list(range(self.size)), "the array released before every run"
        self.whole_released = whole_array
        self.released.update(tasks)
        self.releases.append(sorted(tasks))

    def watch(self, handle, timeout_seconds=None, on_state=None):  # type: ignore[no-untyped-def]
        from blocks.records import JobStatus

        assert self.whole_released, "watched before the array was released"
        if on_state is not None:  # the sweep logs the array's queue state as it changes
            on_state(JobStatus(job_id="42", state="PENDING", reason="Slurm reason: Priority"))
        return JobStatus(job_id="42", state="COMPLETED")

    def array_outcome(self, handle, size):  # type: ignore[no-untyped-def]
        from blocks.records import JobStatus

        usage = {"gpu_hours": 0.0, "cpu_hours": 0.001, "wall_seconds": 1.0, "requeues": 0}
        return {i: (JobStatus(job_id=f"42_{i}", state="COMPLETED"), usage) for i in range(size)}

    def cancel(self, handle):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing to cancel")

    @staticmethod
    def task_dir(workdir: str, index: int) -> str:
        return f"{workdir}/task-{index}"


@pytest.mark.usefixtures("prefect_server")
def test_each_task_is_released_with_its_own_child_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import os
    import threading

    from mlflow.tracking import MlflowClient

    from blocks.records import TrainingJob
    from blocks.tracking.mlflow import MlflowTracking
    from runtime import contract
    from tasks.sweep import CHILD_RUNS_NICE, train_sweep

    tracking = MlflowTracking(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    experiment = tracking.experiment_id("sweep-unit")
    parent = tracking.client.create_run(experiment, run_name="sweep-unit").info.run_id
    configurations = expand(SweepGrid(values={"seed": list(range(12))}))
    job = TrainingJob(key="sweep-unit", workdir=str(tmp_path / "job"), command=["python", "train.py"])
    from prefect import flow

    @flow
    def sweep_step(backend: HeldArray) -> tuple:  # type: ignore[type-arg]
        return train_sweep(backend, job, configurations, tracking, parent, run_workers=3)

    # The child runs are made by threads whose CPU priority is lower than the flow's own by CHILD_RUNS_NICE.
    create_run, made_at = MlflowClient.create_run, set()
    flow_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def recording_create_run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made_at.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return create_run(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", recording_create_run)
    backend = HeldArray()
    children, result = sweep_step(backend)
    assert CHILD_RUNS_NICE > 0 and made_at == {min(flow_nice + CHILD_RUNS_NICE, 19)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == flow_nice  # the flow's own is kept

    assert backend.submits == 1 and len(result.tasks) == 12 and len(result.completed) == 12
    assert len(set(children)) == 12
    for index, settings in backend.released.items():
        assert settings[contract.MLFLOW_RUN_ID] == children[index]
        assert json.loads(settings[contract.HPARAMS])["seed"] == index
        run = tracking.client.get_run(children[index])
        assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["gpuferry.sweep_index"] == str(index)

    # A retried task finds the runs it made (by their index tag) and makes no others.
    again = HeldArray()
    children_again, _ = sweep_step(again)
    assert children_again == children
    assert again.releases == [list(range(12))]  # every run already there: one release


def test_tasks_are_released_in_doubling_parts_then_the_whole_array() -> None:
    """A part goes once FIRST_RELEASE tasks are ready and as many as all the parts before; the rest
    goes as the whole array."""
    import threading
    from concurrent.futures import Future

    from blocks.records import JobHandle
    from runtime import contract
    from tasks.sweep import FIRST_RELEASE, _release_as_runs_come
    from tests.private_worker import wait_until

    assert FIRST_RELEASE == 16
    size = 100
    configurations = expand(SweepGrid(values={"seed": list(range(size))}))
    futures: list[Future[str]] = [Future() for _ in range(size)]
    backend = HeldArray()
    backend.size = size
    handle = JobHandle(backend="held-array", job_id="42", key="k", workdir="/w", log_path="/dev/null")
    runs: dict[int, str] = {}
    policy = threading.Thread(
        target=_release_as_runs_come,
        args=(backend, handle, runs, {f: i for i, f in enumerate(futures)}, configurations),
    )
    policy.start()
    made = 0

    def make(count: int) -> None:
        nonlocal made
        for future in futures[made : made + count]:
            future.set_result(f"run-{made}")
            made += 1

    def parts(count: int) -> None:
        wait_until(f"{count} releases", lambda: len(backend.releases) >= count, timeout=30, interval=0.01)

    make(10)  # fewer than FIRST_RELEASE: nothing goes yet
    make(6)
    parts(1)
    make(10)  # 10 held with a run, fewer than the 16 released: nothing goes
    make(6)
    parts(2)
    make(31)
    make(1)  # 32 held with a run, as many as released before
    parts(3)
    make(size - made)  # the last run (36 held, fewer than 64): the rest as the whole array
    policy.join(timeout=30)
    assert not policy.is_alive()
    assert backend.releases == [list(range(0, 16)), list(range(16, 32)), list(range(32, 64)), list(range(64, 100))]
    assert backend.whole_released
    assert runs == {i: f"run-{i}" for i in range(size)}
    assert {i: backend.released[i][contract.MLFLOW_RUN_ID] for i in range(size)} == runs


@pytest.mark.usefixtures("prefect_server")
def test_a_big_array_is_released_in_parts_then_whole(tmp_path: Path) -> None:
    from prefect import flow

    from blocks.records import TrainingJob
    from blocks.tracking.mlflow import MlflowTracking
    from tasks.sweep import FIRST_RELEASE, train_sweep

    tracking = MlflowTracking(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    parent = tracking.client.create_run(tracking.experiment_id("sweep-parts"), run_name="parts").info.run_id
    configurations = expand(SweepGrid(values={"seed": list(range(200))}))
    job = TrainingJob(key="sweep-parts", workdir=str(tmp_path / "job"), command=["python", "train.py"])

    @flow
    def sweep_step(backend: HeldArray) -> tuple:  # type: ignore[type-arg]
        return train_sweep(backend, job, configurations, tracking, parent)

    backend = HeldArray()
    children, result = sweep_step(backend)
    assert len(set(children)) == 200 and len(result.completed) == 200
    # Each part released by index holds at least FIRST_RELEASE tasks and as many as all before it
    # (tasks released by index cost Slurm a job record each); the last release is the whole array.
    *by_index, rest = backend.releases
    assert backend.whole_released and rest and by_index
    for k, part in enumerate(by_index):
        assert len(part) >= max(FIRST_RELEASE, sum(map(len, by_index[:k]))), backend.releases
    assert len(by_index) <= 4, backend.releases  # 16, 16, 32, 64 at most: then fewer than 128 are left
    assert sorted(i for part in backend.releases for i in part) == list(range(200))
