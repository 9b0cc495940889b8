"""A sweep's steps: its MLflow child runs, its job array, and the children's metrics."""

from __future__ import annotations

import asyncio
import json
import posixpath
from collections.abc import Mapping, Sequence

from prefect import get_run_logger, task
from prefect.exceptions import TerminationSignal

from blocks.compute import ComputeBackend
from blocks.errors import ConfigurationError
from blocks.specs import HyperParameters, SweepJobResult, SweepTaskResult, TrainingJob
from blocks.tracking import MlflowTracking
from tasks.retry import retry_options

SWEEP_INDEX_TAG = "gpuferry.sweep_index"
PARENT_TAG = "mlflow.parentRunId"


def _children(tracking: MlflowTracking, experiment_id: str, parent_run_id: str) -> list:  # type: ignore[type-arg]
    runs, token = [], None
    while True:
        page = tracking.client.search_runs(
            [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=1000,
            page_token=token,
        )  # fmt: skip
        runs += list(page)
        token = page.token
        if not token:
            return runs


@task(name="start-child-runs", **retry_options())
def start_child_runs(tracking: MlflowTracking, parent_run_id: str, configurations: list[HyperParameters]) -> list[str]:
    """One MLflow run per configuration, a child of the sweep's run; a retry finds the ones it made."""
    client = tracking.client
    parent = client.get_run(parent_run_id)
    experiment_id = parent.info.experiment_id
    existing = {run.data.tags.get(SWEEP_INDEX_TAG): run.info.run_id
                for run in _children(tracking, experiment_id, parent_run_id)}  # fmt: skip
    ids = []
    for index, hp in enumerate(configurations):
        run_id = existing.get(str(index))
        if run_id is None:
            run_id = client.create_run(
                experiment_id, run_name=f"{parent.info.run_name}-{index}",
                tags={PARENT_TAG: parent_run_id, SWEEP_INDEX_TAG: str(index),
                      "gpuferry.hparams": json.dumps(hp.model_dump(), sort_keys=True)},
            ).info.run_id  # fmt: skip
        ids.append(run_id)
    get_run_logger().info("%d child runs of %s (%d made now)", len(ids), parent_run_id, len(ids) - len(existing))
    return ids


@task(name="child-metrics", **retry_options())
def child_metrics(tracking: MlflowTracking, parent_run_id: str) -> dict[str, dict[str, float]]:
    """The latest metrics of every child run, in one search."""
    experiment_id = tracking.client.get_run(parent_run_id).info.experiment_id
    return {run.info.run_id: dict(run.data.metrics) for run in _children(tracking, experiment_id, parent_run_id)}


@task(name="mark-children", **retry_options())
def mark_children(tracking: MlflowTracking, run_ids: Sequence[str], status: str) -> None:
    """End child runs whose task did not finish its run itself (it failed, or never started)."""
    for run_id in run_ids:
        if tracking.client.get_run(run_id).info.status == "RUNNING":
            tracking.end_run(run_id, status)


# Submitting is idempotent (the job key): a retry adopts the array instead of starting another.
@task(name="train-sweep", **retry_options(retries=3))
def train_sweep(
    compute: ComputeBackend, job: TrainingJob, tasks: Sequence[Mapping[str, str]], parallelism: int | None = None,
    timeout_seconds: float | None = None,
) -> SweepJobResult:  # fmt: skip
    """Run ``job`` once per entry of ``tasks`` as ONE job array, wait for all of it (one poll per cycle)."""
    logger = get_run_logger()
    submit_sweep = getattr(compute, "submit_sweep", None)
    if submit_sweep is None:
        raise ConfigurationError(
            f"the {compute.backend_name} backend cannot run a sweep (it has no job arrays): use a Slurm stack, "
            "or run one configuration at a time with the retrain flow"
        )
    handle = submit_sweep(job, list(tasks), parallelism=parallelism)
    logger.info("sweep of %d configurations: job array %s (workdir %s)", len(tasks), handle.job_id, handle.workdir)
    try:
        status = compute.watch(handle, timeout_seconds=timeout_seconds)
    except (TerminationSignal, KeyboardInterrupt, asyncio.CancelledError):
        logger.warning("the flow run was stopped: cancelling job array %s", handle.job_id)
        compute.cancel(handle)
        raise
    states = compute.array_tasks(handle, len(tasks))  # type: ignore[attr-defined]
    usage = compute.array_accounting(handle, len(tasks))  # type: ignore[attr-defined]
    results = [
        SweepTaskResult(
            index=i, status=states[i], checkpoint_dir=posixpath.join(compute.task_dir(job.workdir, i), "checkpoints"),  # type: ignore[attr-defined]
            requeues=int(usage[i]["requeues"]), wall_seconds=usage[i]["wall_seconds"],
            gpu_hours=usage[i]["gpu_hours"], cpu_hours=usage[i]["cpu_hours"],
        )  # fmt: skip
        for i in range(len(tasks))
    ]
    failed = [r for r in results if r.status.state != "COMPLETED"]
    for r in failed[:10]:
        logger.warning("configuration %d: %s %s", r.index, r.status.state, r.status.reason)
    logger.info("job array %s %s: %d of %d configurations completed", handle.job_id, status.state,
                len(results) - len(failed), len(results))  # fmt: skip
    return SweepJobResult(
        handle=handle, tasks=results, gpu_hours=sum(r.gpu_hours for r in results),
        cpu_hours=sum(r.cpu_hours for r in results),
    )  # fmt: skip
