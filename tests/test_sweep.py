"""The sweep's grid (validated before anything runs) and its refusal on a backend without job arrays."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks.errors import ConfigurationError
from blocks.specs import HyperParameters, SweepGrid
from blocks.stack import Stack


def test_grid_is_the_cartesian_product_on_the_base() -> None:
    grid = SweepGrid(values={"lr": [0.1, 0.01], "hidden": [16, 32, 64]}, configurations=[{"optimizer": "adam"}])
    assert grid.size == 7
    configs = grid.expand(HyperParameters(epochs=3))
    assert [(c.lr, c.hidden) for c in configs[:6]] == [(0.1, 16), (0.1, 32), (0.1, 64), (0.01, 16), (0.01, 32), (0.01, 64)]
    assert configs[6] == HyperParameters(epochs=3, optimizer="adam")
    assert all(c.epochs == 3 for c in configs)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"values": {"learning_rate": [0.1]}}, r"values\['learning_rate'\]: not a hyperparameter; use one of: epochs, lr"),
        ({"values": {"lr": []}}, r"values\['lr'\] is empty"),
        ({"values": {"lr": [0.1, 0.1]}}, r"values\['lr'\] lists a value twice"),
        ({"values": {"lr": [0.1, -1.0]}}, r"configuration 1 \{'lr': -1.0\}.*lr"),
        ({"configurations": [{"optimizer": "rmsprop"}]}, r"configuration 0 .*optimizer"),
        ({"configurations": [{"depth": 3}]}, r"configurations\[0\]: depth not hyperparameters"),
        ({}, "the sweep is empty"),
        ({"values": {"lr": [0.1, 0.2], "seed": list(range(6))}, "max_configurations": 10},
         "12 configurations, more than max_configurations=10"),
    ],
)
def test_bad_grids_are_refused_naming_the_field(grid: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SweepGrid(**grid)


def test_base_hyperparameters_are_checked_with_each_configuration() -> None:
    grid = SweepGrid(values={"dropout": [0.0, 0.5]})
    assert len(grid.expand(HyperParameters())) == 2
    with pytest.raises(ValueError, match="configuration 0"):
        SweepGrid(configurations=[{"lr": 20.0}])


@pytest.mark.usefixtures("prefect_server")
def test_embedded_stack_refuses_a_sweep_before_anything_runs() -> None:
    from flows.sweep import sweep

    jobs = Stack.embedded().compute.job_workdir("x")
    with pytest.raises(ConfigurationError, match="no job arrays.*Slurm.*retrain"):
        sweep(grid=SweepGrid(values={"lr": [0.1, 0.2]}))
    from pathlib import Path

    assert not any(Path(jobs).parent.glob("*-sweep"))  # nothing was submitted


class HeldArray:
    """A job array backend that records what the sweep task asks of it (no cluster)."""

    backend_name = "held-array"

    def __init__(self) -> None:
        self.released: dict[int, dict[str, str]] = {}
        self.releases: list[list[int]] = []
        self.whole_released = False
        self.submits = 0

    def submit_held_sweep(self, job, size, *, parallelism=None):  # type: ignore[no-untyped-def]
        from blocks.specs import JobHandle

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

    def watch(self, handle, timeout_seconds=None):  # type: ignore[no-untyped-def]
        from blocks.specs import JobStatus

        assert self.whole_released, "watched before the array was released"
        return JobStatus(job_id="42", state="COMPLETED")

    def array_outcome(self, handle, size):  # type: ignore[no-untyped-def]
        from blocks.specs import JobStatus

        usage = {"gpu_hours": 0.0, "cpu_hours": 0.001, "wall_seconds": 1.0, "requeues": 0}
        return {i: (JobStatus(job_id=f"42_{i}", state="COMPLETED"), usage) for i in range(size)}

    def cancel(self, handle):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing to cancel")

    @staticmethod
    def task_dir(workdir: str, index: int) -> str:
        return f"{workdir}/task-{index}"


@pytest.mark.usefixtures("prefect_server")
def test_each_task_is_released_with_its_own_child_run(tmp_path: Path) -> None:
    import json

    from blocks.specs import TrainingJob
    from blocks.tracking import MlflowTracking
    from tasks.sweep import train_sweep
    from workload import contract

    tracking = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                              artifact_location=(tmp_path / "artifacts").as_uri())  # fmt: skip
    experiment = tracking.experiment_id("sweep-unit")
    parent = tracking.client.create_run(experiment, run_name="sweep-unit").info.run_id
    configurations = SweepGrid(values={"seed": list(range(12))}).expand(HyperParameters())
    job = TrainingJob(key="sweep-unit", workdir=str(tmp_path / "job"))
    from prefect import flow

    @flow
    def sweep_step(backend: HeldArray) -> tuple:  # type: ignore[type-arg]
        return train_sweep(backend, job, configurations, tracking, parent, run_workers=3)

    backend = HeldArray()
    children, result = sweep_step(backend)

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


@pytest.mark.usefixtures("prefect_server")
def test_a_big_array_is_released_in_a_first_part_then_whole(tmp_path: Path) -> None:
    from prefect import flow

    from blocks.specs import TrainingJob
    from blocks.tracking import MlflowTracking
    from tasks.sweep import FIRST_RELEASE, train_sweep

    tracking = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                              artifact_location=(tmp_path / "artifacts").as_uri())  # fmt: skip
    parent = tracking.client.create_run(tracking.experiment_id("sweep-parts"), run_name="parts").info.run_id
    configurations = SweepGrid(values={"seed": list(range(200))}).expand(HyperParameters())
    job = TrainingJob(key="sweep-parts", workdir=str(tmp_path / "job"))

    @flow
    def sweep_step(backend: HeldArray) -> tuple:  # type: ignore[type-arg]
        return train_sweep(backend, job, configurations, tracking, parent)

    backend = HeldArray()
    children, result = sweep_step(backend)
    assert len(set(children)) == 200 and len(result.completed) == 200
    # Tasks released by index cost Slurm a job record each: the first few, to start the cluster while
    # the other runs are made, then every other task as the array itself.
    first, rest = backend.releases
    assert len(first) == FIRST_RELEASE and len(rest) == 200 - FIRST_RELEASE and backend.whole_released
