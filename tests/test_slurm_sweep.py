"""The sweep flow on the real local Slurm as a remote cluster (over SSH, its own filesystem and Python, logging
to the mlflow stack's server): one job array, a child MLflow run per configuration, the best child through
upload (by the cluster, into the s3 stack) → register → deploy, and sacct's GPU/CPU-hours in MLflow."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources, ServingSpec, SweepGrid, TrainingSpec
from blocks.stack import Stack
from blocks.workload.source import load_workload
from flows.sweep import sweep
from tests.examples import DIABETES, DIGITS, JOBS, code_of
from tests.stacks import mlflow_server, remote_slurm, remove_on_cluster, s3_store, stack_env
from tests.test_pipeline_slurm import TEST_BUCKET

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parent.parent


def _cluster(**options: object) -> SlurmCluster:
    """The slurm stack as a remote cluster (its own filesystem and Python; tests/stacks.py)."""
    return remote_slurm("sweep", poll_interval_start=0.5, poll_interval_max=3.0, **options)


def _slurm(env: dict[str, str], *argv: str) -> list[list[str]]:
    out = subprocess.run(
        argv, env={"SLURM_CONF": env["SLURM_CONF"], "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True
    ).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def test_sweep_trains_a_grid_as_one_array_and_ships_the_best() -> None:
    env = stack_env("slurm")
    stack = Stack.embedded()
    # A GPU per task from the cluster's settings: the stack's node provider is this (GPU-less)
    # machine, which would refuse resources.gpus_per_node > 0 in its preflight.
    stack.compute = _cluster(additional_directives={"gpus-per-task": "1"})
    stack.storage = s3_store(TEST_BUCKET)  # the cluster stores the best model itself
    stack.tracking = mlflow_server()  # the array's tasks log to it over the network
    stack.save("slurm-sweep-test", overwrite=True)
    grid = SweepGrid(values={"lr": [0.002, 0.1], "hidden": [8, 64]})
    outcome = sweep(
        workload=str(DIGITS),
        grid=grid,
        training=TrainingSpec(
            model_name=f"digits-sweep-{uuid.uuid4().hex[:6]}",  # the server's registry persists
            hyperparameters={"epochs": 2, "batch_size": 32},
            resources=Resources(mem_gb=1, time_limit_minutes=10),
        ),
        serving=ServingSpec(service_name="digits-sweep"),
        stack="slurm-sweep-test",
        force_deploy=True,
    )
    try:
        client = stack.tracking.client
        parent = client.get_run(outcome.parent_run_id)
        assert outcome.completed == 4 and outcome.failed == 0
        children = [client.get_run(r) for r in outcome.child_run_ids]
        schema = load_workload(str(DIGITS)).definition.schema
        configs = schema.expand_grid(schema.validate({"epochs": 2, "batch_size": 32}), grid.values, [])
        for child, hp in zip(children, configs, strict=True):
            assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
            assert child.info.status == "FINISHED"
            # The array task trained ITS configuration, into ITS run (the workload logged these).
            assert {k: child.data.params[k] for k in ("lr", "hidden")} == {
                "lr": str(hp["lr"]),
                "hidden": str(hp["hidden"]),
            }
            assert "val_accuracy" in child.data.metrics
        accuracies = [c.data.metrics["val_accuracy"] for c in children]
        assert outcome.best_index == accuracies.index(max(accuracies))
        assert outcome.best_hyperparameters == configs[outcome.best_index]
        assert max(accuracies) > 0.8 and min(accuracies) < max(accuracies)  # the grid made a difference
        # The best child went on: registered from ITS run, deployed.
        assert outcome.pipeline.model_version.run_id == outcome.child_run_ids[outcome.best_index]
        assert outcome.pipeline.model_version.value == pytest.approx(max(accuracies))
        assert outcome.pipeline.deployed
        assert parent.data.tags["best_child_run_id"] == outcome.child_run_ids[outcome.best_index]
        # The deploy's outcome is recorded on the sweep's run and on the best child (the version's source run),
        # and on no other child.
        endpoint = outcome.pipeline.endpoint
        assert endpoint is not None
        deployed = {
            "deploy.status": "deployed",
            "deploy.version": outcome.pipeline.model_version.version,
            "deploy.endpoint": endpoint.url,
            "deploy.backend": endpoint.backend,
        }
        for run in (parent, children[outcome.best_index]):
            tags = {k: v for k, v in run.data.tags.items() if k.startswith("deploy.")}
            assert {k: tags.get(k) for k in deployed} == deployed, run.info.run_id
            assert not {"deploy.reason", "deploy.failed_version", "deploy.rolled_back_to"} & set(tags)
        others = [c for i, c in enumerate(children) if i != outcome.best_index]
        assert not [k for c in others for k in c.data.tags if k.startswith("deploy.")]

        # ONE Slurm job (an array of 4 tasks) carried the whole sweep ...
        key = f"{parent.data.tags['prefect.flow_run_id']}-sweep"
        rows = _slurm(
            env, "sacct", "-X", "-n", "-P", "-S", "now-1hour", f"--name={key}", "-o", "JobID,State,ElapsedRaw,AllocTRES"
        )
        assert len({r[0].split("_")[0] for r in rows}) == 1
        assert sorted(r[0].split("_")[1] for r in rows) == ["0", "1", "2", "3"] and {r[1] for r in rows} == {
            "COMPLETED"
        }
        # ... and its accounting (allocated GPUs × elapsed, from sacct) is in the MLflow runs.
        gpu_hours = sum(int(r[2]) * int(r[3].split("gres/gpu=")[1].split(",")[0]) for r in rows) / 3600
        assert gpu_hours > 0
        assert parent.data.metrics["gpu_hours"] == pytest.approx(gpu_hours)
        assert parent.data.metrics["cpu_hours"] > 0
        best = client.get_run(outcome.child_run_ids[outcome.best_index])
        assert 0 < best.data.metrics["gpu_hours"] < gpu_hours
        assert json.loads(best.data.tags["gpuferry.hparams"]) == outcome.best_hyperparameters
    finally:
        stack.serving.undeploy("digits-sweep")
        remove_on_cluster(stack.compute, stack.compute.workdir_root)


def test_a_sweep_of_the_regressors_own_hyperparameters_is_one_array() -> None:
    """The scikit-learn example's alpha × l1_ratio on Slurm: the same flow, its schema, its metric (minimised)."""
    env = stack_env("slurm")
    stack = Stack.embedded()
    stack.compute = _cluster()
    stack.storage = s3_store(TEST_BUCKET)
    stack.tracking = mlflow_server()
    stack.save("slurm-sweep-regressor", overwrite=True)
    grid = SweepGrid(values={"alpha": [0.001, 1.0, 30.0], "l1_ratio": [0.2, 0.9]})
    outcome = sweep(
        workload=str(DIABETES),
        grid=grid,
        stack="slurm-sweep-regressor",
        training=TrainingSpec(model_name=f"diabetes-sweep-{uuid.uuid4().hex[:6]}", resources=Resources(mem_gb=1)),
        serving=ServingSpec(service_name="diabetes-sweep"),
    )
    try:
        client = stack.tracking.client
        assert outcome.completed == 6 and outcome.failed == 0
        rmse = [client.get_run(r).data.metrics["val_rmse"] for r in outcome.child_run_ids]
        assert outcome.best_index == rmse.index(min(rmse))  # minimise: the workload's direction
        assert outcome.best_hyperparameters["alpha"] == 0.001 or rmse[outcome.best_index] == min(rmse)
        assert outcome.pipeline.model_version.metric == "val_rmse" and outcome.pipeline.deployed
        key = f"{client.get_run(outcome.parent_run_id).data.tags['prefect.flow_run_id']}-sweep"
        rows = _slurm(env, "sacct", "-X", "-n", "-P", "-S", "now-1hour", f"--name={key}", "-o", "JobID,State")
        assert len({r[0].split("_")[0] for r in rows}) == 1 and len(rows) == 6  # one array of six tasks
    finally:
        stack.serving.undeploy("diabetes-sweep")
        remove_on_cluster(stack.compute, stack.compute.workdir_root)


class _TrackingDown:
    """An MLflow client whose run creation fails as if the tracking server were unreachable."""

    def __init__(self, client: MlflowClient) -> None:
        self.client, self.attempts = client, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)

    def create_run(self, *args: object, **kwargs: object) -> object:
        self.attempts += 1
        raise ConnectionError("tracking server unreachable")


def test_a_sweep_that_fails_for_good_cancels_its_held_array(tmp_path: Path) -> None:
    from prefect import flow

    from blocks.records import TrainingJob
    from blocks.tracking.mlflow import MlflowTracking
    from tasks.sweep import train_sweep

    env = stack_env("slurm")
    cluster = _cluster()
    tracking = MlflowTracking(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    parent = tracking.client.create_run(tracking.experiment_id("sweep-cancel"), run_name="sweep-cancel").info.run_id
    down = _TrackingDown(tracking.client)
    object.__setattr__(tracking, "client", down)  # the cached client: every child run fails to be made
    key = f"sweep-cancel-{uuid.uuid4().hex[:8]}"
    job = TrainingJob(
        key=key,
        workdir=cluster.job_workdir(key),
        command=["true"],
        code=code_of(JOBS),
        resources=Resources(time_limit_minutes=5),
    )
    configurations = [{"seed": seed} for seed in range(4)]

    @flow
    def sweep_step() -> object:
        # A transient error: the first attempt leaves the array held for the retry, which adopts it;
        # the last attempt gives up and cancels it.
        return train_sweep.with_options(retries=1, retry_delay_seconds=0)(
            cluster, job, configurations, tracking, parent
        )

    try:
        with pytest.raises(ConnectionError, match="tracking server unreachable"):
            sweep_step()
        assert down.attempts >= 2  # both attempts tried to make child runs
        # ONE array (the retry adopted it), cancelled while held: none of its tasks ran.
        live = _slurm(env, "squeue", "-h", "-t", "all", f"--name={key}", "-o", "%F|%T|%r")
        assert len({r[0] for r in live}) == 1 and {r[1] for r in live} == {"CANCELLED"}, live
        _, logs, _ = cluster.run(["find", job.workdir, "-name", "task-*.log"], check=False)
        assert not logs.strip(), logs
        rows: list[list[str]] = []
        deadline = time.monotonic() + 120  # sacct lags the controller
        while time.monotonic() < deadline:
            # By id: a time window (-S) leaves out a job that never became eligible (Eligible=Unknown).
            rows = _slurm(env, "sacct", "-X", "-n", "-P", "-j", live[0][0], "-o", "JobID,State,ElapsedRaw")
            if rows and all(r[1].startswith("CANCELLED") for r in rows):
                break
            time.sleep(2)
        assert rows and all(r[1].startswith("CANCELLED") for r in rows), rows
        assert all(r[2] == "0" for r in rows), rows  # no time ran (sacct may date a pending job's cancel as its start)
    finally:
        subprocess.run(
            ["scancel", f"--name={key}"], env={"SLURM_CONF": env["SLURM_CONF"], "PATH": "/usr/bin:/bin"}, check=False
        )
        remove_on_cluster(cluster, cluster.workdir_root)
