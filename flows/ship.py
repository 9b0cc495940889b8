"""The tail every training flow shares: upload the trained model → register it → deploy it, and the
deploy's outcome recorded in MLflow. Composition only: each step is a task.

``deploy_and_record`` is the one place a deploy's outcome reaches MLflow, as ``deploy.*`` tags on the
model version, on its source run and on any other run given (a sweep's parent run): ``deployed``
(version, endpoint), ``rolled_back`` (the failed version, the version serving again, the rollout's
reason) or ``failed`` (the error). A deploy that did not serve the new version still fails the flow.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import NamedTuple

from prefect import get_run_logger

from blocks.plan import RunPlan, server_of
from blocks.serving import DeployOutcome, Release
from blocks.specs import CheckpointRef, Endpoint, ImageRef, JobResult, ModelVersionRef, ServingSpec, SweepTaskResult
from blocks.stack import Stack
from runtime import contract
from tasks.deploy import deploy
from tasks.track import log_run, record_deploy, register_model
from tasks.upload import inspect_model, serving_example, store_model


class Shipped(NamedTuple):
    checkpoint: CheckpointRef
    version: ModelVersionRef
    endpoint: Endpoint | None


def ship(
    blocks: Stack,
    run: RunPlan,
    *,
    run_id: str,
    trained: JobResult | SweepTaskResult,
    value: float,
    image: ImageRef,
    force_deploy: bool = False,
    runs: Sequence[str] = (),
) -> Shipped:
    """Store the MLflow model ``trained`` wrote in run ``run_id``, register it, and serve it when promoted (or
    forced).

    ``value`` is the run's ``promotion.metric``; ``runs`` are other runs that record the deploy's outcome.
    """
    final_dir = posixpath.join(trained.checkpoint_dir, contract.FINAL_DIRNAME)  # where the job wrote it
    model = inspect_model(blocks.compute, final_dir)
    run.check_model(model, final_dir)  # before anything is stored or registered
    checkpoint = store_model(blocks.compute, blocks.storage, final_dir, f"{run.model_name}/{run_id}")
    log_run(
        blocks.tracking, run_id,
        metrics={"gpu_hours": trained.gpu_hours, "cpu_hours": trained.cpu_hours, "requeues": trained.requeues,
                 "train_wall_seconds": trained.wall_seconds},
        tags={"checkpoint_uri": checkpoint.uri, "checkpoint_sha256": checkpoint.sha256,
              "checkpoint_size_bytes": str(checkpoint.size_bytes), "mlflow_model.flavors": ",".join(model.flavors)},
    )  # fmt: skip
    version = register_model(blocks.tracking, run_id, run.model_name, checkpoint, run.promotion, value,
                             run.version_tags(image))  # fmt: skip
    endpoint = None
    if version.promoted or force_deploy:
        smoke = run.serving.smoke_request
        if smoke is None and model.serving_example:
            smoke = serving_example(blocks.storage, checkpoint.uri, model.serving_example)
        release = Release(
            model_name=version.name, version=version.version, model_uri=checkpoint.uri,
            image=image if image.reference else None, server=server_of(run.workload, image),
            checkpoint_sha256=checkpoint.sha256, store_env=blocks.storage.reader_env(),
        )  # fmt: skip
        spec = run.serving.model_copy(update={"smoke_request": smoke or run.workload.definition.serve.input_example})
        endpoint = deploy_and_record(blocks, spec, release, runs)
    else:
        get_run_logger().info("v%s was not promoted: not deployed (force_deploy=true deploys it)", version.version)
    return Shipped(checkpoint, version, endpoint)


def deploy_and_record(blocks: Stack, serving: ServingSpec, release: Release, runs: Sequence[str] = ()) -> Endpoint:
    """Deploy ``release`` and record the outcome on the model version, its source run and ``runs``.

    A deploy that raised (rolled back, failed) raises again once its outcome is recorded; when MLflow
    cannot take the record either, the deploy's error is the one raised.
    """
    try:
        endpoint = deploy(blocks.serving, serving, release)
    except Exception as exc:
        outcome = DeployOutcome.from_error(release, exc)
        try:
            record_deploy(blocks.tracking, outcome, list(runs))
        except Exception as record_error:
            get_run_logger().error(
                "the deploy's outcome (%s: %s) could not be recorded in MLflow: %s", outcome.status, outcome.reason,
                record_error,
            )  # fmt: skip
        raise
    record_deploy(blocks.tracking, DeployOutcome.deployed(release, endpoint), list(runs))
    return endpoint
