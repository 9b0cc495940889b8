"""The tail every training flow shares: upload the trained model → register it → deploy it, and the
deploy's outcome recorded in MLflow. Composition only: each step is a task.

``deploy_and_record`` is the one place a deploy's outcome reaches MLflow, as ``deploy.*`` tags on the
model version, on its source run and on any other run given (a sweep's parent run): ``deployed``
(version, endpoint), ``rolled_back`` (the failed version, the version serving again, the rollout's
reason), ``canary_failed`` (the same, and what its window measured, ``deploy.rollout.*``) or ``failed`` (the
error). A deploy that did not serve the new version still fails the flow. With a canary or shadow rollout
(``serve.rollout``), a version that beat the champion moves the alias only once it passed.
"""

from __future__ import annotations

import json
import posixpath
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from blocks.base.serving import DeployOutcome, Release
from blocks.plan import RunPlan, server_of
from blocks.records import (
    RUN_IMAGE_TAG,
    CheckpointRef,
    Endpoint,
    ImageRef,
    JobResult,
    ModelVersionRef,
    PipelineResult,
    SweepTaskResult,
)
from blocks.specs import ServingSpec
from blocks.stack import Stack
from runtime import contract
from tasks.deploy import deploy
from tasks.track import log_run, record_deploy, register_model, set_alias
from tasks.upload import inspect_model, serving_example, store_model
from tasks.waiting import RUN_MODEL_LABEL, label_run


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
        blocks.tracking,
        run_id,
        metrics={
            "gpu_hours": trained.gpu_hours,
            "cpu_hours": trained.cpu_hours,
            "requeues": trained.requeues,
            "train_wall_seconds": trained.wall_seconds,
        },
        tags={
            "checkpoint_uri": checkpoint.uri,
            "checkpoint_sha256": checkpoint.sha256,
            "checkpoint_size_bytes": str(checkpoint.size_bytes),
            "mlflow_model.flavors": ",".join(model.flavors),
        },
    )
    # A version judged by live traffic (canary, shadow) becomes the champion only once it passed.
    judged = run.serving.rollout is not None and run.serving.rollout.strategy != "rolling"
    version = register_model(
        blocks.tracking,
        run_id,
        run.model_name,
        checkpoint,
        run.promotion,
        value,
        run.version_tags(image),
        move_alias=not judged,
    )
    label_run({RUN_MODEL_LABEL: f"{version.name} v{version.version} {version.metric}={value:.4g}"})
    endpoint = None
    if version.promoted or force_deploy:
        smoke = run.serving.smoke_request
        if smoke is None and model.serving_example:
            smoke = serving_example(blocks.storage, checkpoint.uri, model.serving_example)
        release = Release(
            model_name=version.name,
            version=version.version,
            model_uri=checkpoint.uri,
            image=image if image.reference else None,
            server=server_of(run.workload, image),
            checkpoint_sha256=checkpoint.sha256,
            store_env=blocks.storage.reader_env(),
        )
        spec = run.serving.model_copy(update={"smoke_request": smoke or run.workload.definition.serve.input_example})
        endpoint = serve_version(blocks, spec, release, version, run.promotion.alias, runs)
    else:
        get_run_logger().info("v%s was not promoted: not deployed (force_deploy=true deploys it)", version.version)
    return Shipped(checkpoint, version, endpoint)


def serve_version(
    blocks: Stack,
    serving: ServingSpec,
    release: Release,
    version: ModelVersionRef,
    alias: str,
    runs: Sequence[str] = (),
) -> Endpoint:
    """Deploy the registered ``version`` and record the outcome; with a canary or shadow rollout, a version that
    beat the champion (registered without moving ``alias``) gets the alias once it passed."""
    endpoint = deploy_and_record(blocks, serving, release, runs)
    judged = serving.rollout is not None and serving.rollout.strategy != "rolling"
    if judged and version.promoted and version.champion_before != version.version:
        set_alias(blocks.tracking, version.name, alias, version.version)
    return endpoint


def deploy_and_record(blocks: Stack, serving: ServingSpec, release: Release, runs: Sequence[str] = ()) -> Endpoint:
    """Deploy ``release`` and record the outcome on the model version, its source run and ``runs``.

    A deploy that raised (rolled back, failed) raises again once its outcome is recorded; when MLflow
    cannot take the record either, the deploy's error is the one raised.
    """
    try:
        endpoint = deploy(blocks.serving, serving, release)
    except Exception as exc:  # every failure of a deploy is recorded as its outcome, then raised
        outcome = DeployOutcome.from_error(release, exc)
        try:
            record_deploy(blocks.tracking, outcome, list(runs))
        except Exception as record_error:  # noqa: BLE001 - the deploy's own error is raised below; this one is logged
            get_run_logger().error(
                "the deploy's outcome (%s: %s) could not be recorded in MLflow: %s",
                outcome.status,
                outcome.reason,
                record_error,
            )
        raise
    record_deploy(blocks.tracking, DeployOutcome.deployed(release, endpoint), list(runs))
    return endpoint


# ---- what every training flow tags its run with, and reports --------------------------------------------


def run_tags(blocks: Stack, image: ImageRef, run_key: str, run: RunPlan) -> dict[str, str]:
    tags = {f"backend.{step}": slug for step, slug in blocks.backends().items()}
    tags.update(run.workload.run_tags())
    tags.update(
        {
            "gpuferry.git_sha": git_sha(),
            "prefect.flow_run_id": run_key,
            RUN_IMAGE_TAG: image.reference or image.note,
            "image.content_tag": image.content_tag,
            "image.built": str(image.built).lower(),
            "image.note": image.note,
        }
    )
    return tags


def git_sha() -> str:
    """The commit of gpuferry itself (the workload's own commit is tagged separately): the checkout's, or, for a
    package installed from a git URL (``uv tool install git+...``), the commit the installer recorded."""
    root = Path(__file__).resolve().parent.parent
    try:
        top, sha = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        if Path(top).resolve() == root:
            return sha
    except (subprocess.SubprocessError, OSError, ValueError):
        pass
    try:
        from importlib.metadata import distribution

        direct_url = json.loads(distribution("gpuferry").read_text("direct_url.json") or "{}")
        return direct_url.get("vcs_info", {}).get("commit_id") or "unknown"
    except (ImportError, OSError, ValueError):
        return "unknown"


def ended_as(exc: BaseException) -> str:
    """The MLflow status of a run its flow left by ``exc``: KILLED when the flow run was cancelled or stopped,
    FAILED otherwise."""
    from prefect.exceptions import Abort, TerminationSignal

    return "KILLED" if isinstance(exc, (Abort, TerminationSignal, KeyboardInterrupt)) else "FAILED"


def report(outcome: PipelineResult) -> None:
    v = outcome.model_version
    endpoint = outcome.endpoint.url if outcome.endpoint else "not deployed (not promoted)"
    champion = f"v{v.champion_before} ({v.champion_value:.4f})" if v.champion_value is not None else "none"
    create_markdown_artifact(
        key="retrain-summary",
        markdown=(
            f"# Retrain: {v.name} v{v.version}\n\n"
            f"| | |\n|---|---|\n"
            f"| MLflow run | {outcome.run_url} |\n"
            f"| checkpoint | `{outcome.checkpoint.uri}` |\n"
            f"| checkpoint sha256 | `{outcome.checkpoint.sha256}` |\n"
            f"| image | {outcome.image.reference or outcome.image.note} |\n"
            f"| {v.metric} | {v.value:.4f} (champion before: {champion}) |\n"
            f"| promoted | {'yes' if v.promoted else 'no'} |\n"
            f"| endpoint | {endpoint} |\n"
        ),
        description="What this retrain produced and where to look",
    )
    create_table_artifact(
        key="final-metrics",
        table=[{"metric": k, "value": f"{val:.6g}"} for k, val in sorted(outcome.metrics.items())],
        description="Final metrics of the training run",
    )
