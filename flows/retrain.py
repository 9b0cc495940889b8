"""The retraining pipeline: provision → build → train → upload → register → deploy → release."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import Pause
from prefect.runtime import flow_run

from blocks.errors import ConfigurationError
from blocks.provision import NodeRequirements
from blocks.specs import ImageRef, PipelineResult, PromotionPolicy, ServingSpec, TrainingJob, TrainingSpec
from blocks.stack import Stack
from flows.ship import ship
from tasks.build import build_image
from tasks.deploy import serving_preflight
from tasks.provision import provision_nodes, release_nodes
from tasks.track import finish_run, run_metrics, start_run
from tasks.train import train, train_suspending
from runtime import contract


@flow(name="retrain", log_prints=True)
def retrain(
    training: TrainingSpec = TrainingSpec(),
    serving: ServingSpec = ServingSpec(),
    promotion: PromotionPolicy = PromotionPolicy(),
    stack: str | None = None,
    force_deploy: bool = False,
    wait: Literal["block", "suspend"] = "block",
) -> PipelineResult:
    """Train the workload, store and register the model, and serve it if it beats the champion.

    Args:
        training: what to train and on what resources.
        serving: how the inference service runs.
        promotion: when the new version replaces the champion (only a promoted version is deployed).
        stack: name of a saved ``Stack`` block choosing the backend of each step (empty: embedded).
        force_deploy: deploy the new version even when it is not promoted.
        wait: how the run waits for the training job: ``block`` keeps this run's process polling it;
            ``suspend`` suspends the run (no process) until deployments/job_watcher.py resumes it.
    """
    blocks = load_stack(stack)
    preflight(blocks, training, serving)
    serving_preflight(blocks.serving, serving)  # before nodes are acquired and days of training start
    run_key = f"{flow_run.get_id() or 'local'}"
    suspended = False

    nodes = provision_nodes(
        blocks.provider, training.resources.nodes, NodeRequirements(gpus=training.resources.gpus_per_node), run_key
    )
    try:
        image = build_image(blocks.images)
        run_id = start_run(
            blocks.tracking, training.experiment, f"retrain-{flow_run.get_name() or run_key}",
            params=run_params(training), tags=run_tags(blocks, image, run_key),
        )  # fmt: skip
        try:
            job = TrainingJob(
                key=f"{run_key}-train", workdir=blocks.compute.job_workdir(f"{run_key}-train"),
                env=training_env(training, blocks.tracking.tracking_uri, run_id),
                resources=training.resources, image=image if image.reference else None,
            )  # fmt: skip
            timeout = training.resources.time_limit_minutes * 60
            if wait == "suspend":
                result = train_suspending(blocks.compute, job, stack=stack or "", timeout_seconds=timeout)
            else:
                result = train(blocks.compute, job, timeout_seconds=timeout)

            metrics = run_metrics(blocks.tracking, run_id)
            if promotion.metric not in metrics:
                raise ConfigurationError(
                    f"promotion.metric={promotion.metric!r} was not logged by the run; it logged: {sorted(metrics)}"
                )
            checkpoint, version, endpoint = ship(
                blocks, model_name=training.model_name, run_id=run_id, trained=result, promotion=promotion,
                value=metrics[promotion.metric], serving=serving, image=image, force_deploy=force_deploy,
            )  # fmt: skip
        except Pause:  # suspended while the job runs: the run, its nodes and its job carry on
            suspended = True
            raise
        except BaseException:
            finish_run(blocks.tracking, run_id, "FAILED")
            raise
        finish_run(blocks.tracking, run_id)
    finally:
        if not suspended:
            release_nodes(blocks.provider, nodes)

    outcome = PipelineResult(
        run_id=run_id, run_url=blocks.tracking.run_url(run_id), image=image, checkpoint=checkpoint,
        model_version=version, metrics=metrics, endpoint=endpoint, deployed=endpoint is not None,
    )  # fmt: skip
    report(outcome)
    return outcome


# ---- composition helpers (no outside calls) ------------------------------------------------


def load_stack(name: str | None) -> Stack:
    """The saved ``Stack`` block called ``name``, or the embedded stack."""
    return Stack.embedded() if not name else Stack.load(name)


def preflight(blocks: Stack, training: TrainingSpec, serving: ServingSpec) -> None:
    """Every check that needs no outside call, before anything is acquired or submitted (the serving
    backend's checks against its cluster follow: ``serving_preflight``)."""
    blocks.compute.validate_job(
        TrainingJob(key="preflight", workdir="/nonexistent", resources=training.resources, image=preflight_image(blocks))
    )
    check_images_for_serving(blocks)
    blocks.serving.validate(serving)


def check_images_for_serving(blocks: Stack) -> None:
    """A serving backend that runs containers needs a stack that builds the image it runs."""
    if blocks.serving.needs_image and not blocks.images.produces_image:
        raise ConfigurationError(
            f"stack.serving ({type(blocks.serving).__name__}) runs the workload's container image, but "
            f"stack.images ({type(blocks.images).__name__}) builds none: choose an image builder that pushes "
            "one (DockerImageBuilder) in the stack"
        )


def preflight_image(blocks: Stack) -> ImageRef | None:
    """A stand-in for the image the build step will pin, when the stack builds one: the job then runs
    inside it, so that path is checked (a container runtime, not the cluster's code_dir, is needed)."""
    if not blocks.images.produces_image:
        return None
    return ImageRef(builder="preflight", content_tag="preflight", reference=f"preflight/image@sha256:{'0' * 64}")


def run_params(training: TrainingSpec) -> dict[str, object]:
    params: dict[str, object] = dict(training.hyperparameters.model_dump())
    params.update({f"resources.{k}": v for k, v in training.resources.model_dump().items()})
    params["checkpoint_every"] = training.checkpoint_every
    return params


def run_tags(blocks: Stack, image: ImageRef, run_key: str) -> dict[str, str]:
    tags = {f"backend.{step}": slug for step, slug in blocks.backends().items()}
    tags.update({
        "git_sha": git_sha(), "prefect.flow_run_id": run_key,
        "image": image.reference or image.note, "image.content_tag": image.content_tag,
        "image.built": str(image.built).lower(), "image.note": image.note,
    })  # fmt: skip
    return tags


def training_env(training: TrainingSpec, tracking_uri: str, run_id: str) -> dict[str, str]:
    return {
        contract.HPARAMS: json.dumps(training.hyperparameters.model_dump()),
        contract.CHECKPOINT_EVERY: str(training.checkpoint_every),
        contract.MLFLOW_TRACKING_URI: tracking_uri,
        contract.MLFLOW_RUN_ID: run_id,
    }


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return "unknown"


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
