"""The retraining pipeline: provision → build → train → upload → register → deploy → release."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import Pause
from prefect.runtime import flow_run

from blocks.errors import ConfigurationError
from blocks.plan import RunPlan
from blocks.provision import NodeRequirements
from blocks.specs import ImageRef, PipelineResult, PromotionPolicy, ServingSpec, TrainingSpec
from blocks.stack import Stack
from flows.ship import ship
from runtime import contract
from tasks.build import build_image
from tasks.deploy import serving_preflight
from tasks.provision import provision_nodes, release_nodes, with_host_gpus
from tasks.track import finish_run, run_metrics, start_run
from tasks.train import train, train_suspending
from tasks.workload import load, plan


@flow(name="retrain", log_prints=True)
def retrain(
    workload: str,
    training: TrainingSpec = TrainingSpec(),
    serving: ServingSpec = ServingSpec(),
    promotion: PromotionPolicy = PromotionPolicy(),
    stack: Stack | str | None = None,
    force_deploy: bool = False,
    wait: Literal["block", "suspend"] = "block",
) -> PipelineResult:
    """Train the workload, store and register the model, and serve it if it beats the champion.

    Args:
        workload: the directory holding the workload's gpuferry.yaml, or git+URL@REF#subdirectory=PATH.
        training: hyperparameters (checked against the workload's schema) and resources; empty fields come
            from the workload.
        serving: how the inference service runs.
        promotion: when the new version replaces the champion (only a promoted version is deployed).
        stack: the saved ``Stack`` block choosing the backend of each step (the UI offers the saved ones), or its
            name (empty: embedded).
        force_deploy: deploy the new version even when it is not promoted.
        wait: how the run waits for the training job: ``block`` keeps this run's process polling it;
            ``suspend`` suspends the run (no process) until deployments/job_watcher.py resumes it.
    """
    blocks = load_stack(stack)
    work = load(workload)
    run = plan(work, training, serving, promotion)
    blocks = with_host_gpus(blocks)  # Docker hosts: every GPU request is checked against the host's GPUs below
    preflight(blocks, run)
    serving_preflight(blocks.serving, run.serving)  # before nodes are acquired and days of training start
    run_key = f"{flow_run.get_id() or 'local'}"
    suspended = False

    nodes = provision_nodes(
        blocks.provider, run.resources.nodes, NodeRequirements(gpus=run.resources.gpus_per_node), run_key
    )
    blocks = blocks.with_inventory(nodes)  # backends that choose GPUs themselves learn their host's
    try:
        blocks.check_gpus(run.resources, run.serving)  # nodes made on demand: their GPUs are known only now
        image = build_image(blocks.images, work)
        run_id = start_run(
            blocks.tracking, run.experiment, f"retrain-{flow_run.get_name() or run_key}",
            params=run.params(), tags=run_tags(blocks, image, run_key, run),
        )  # fmt: skip
        try:
            job = run.job(
                f"{run_key}-train", blocks.compute.job_workdir(f"{run_key}-train"), image,
                env={contract.MLFLOW_TRACKING_URI: blocks.tracking.tracking_uri, contract.MLFLOW_RUN_ID: run_id},
                secret_env=blocks.tracking.job_secrets(),
            )  # fmt: skip
            timeout = run.resources.time_limit_minutes * 60
            if wait == "suspend":
                result = train_suspending(blocks.compute, job, stack=stack_name(stack), timeout_seconds=timeout)
            else:
                result = train(blocks.compute, job, timeout_seconds=timeout)

            metrics = run_metrics(blocks.tracking, run_id)
            metric = run.promotion.metric
            if metric not in metrics:
                raise ConfigurationError(
                    f"promotion.metric={metric!r} was not logged by the run; it logged: {sorted(metrics)}"
                )
            checkpoint, version, endpoint = ship(
                blocks, run, run_id=run_id, trained=result, value=metrics[metric], image=image,
                force_deploy=force_deploy,
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


def load_stack(stack: Stack | str | None) -> Stack:
    """The stack a run was given: a ``Stack`` block (picked in the UI), the name of a saved one (an error lists
    the saved stacks when there is none by that name), or nothing: the embedded stack."""
    if isinstance(stack, Stack):
        return stack
    return Stack.embedded() if not stack else Stack.named(stack)


def stack_name(stack: Stack | str | None) -> str:
    """The saved name of the run's stack ('' = embedded), for what must find it again (the job watcher)."""
    if isinstance(stack, Stack):
        name = stack._block_document_name
        if not name or stack._is_anonymous:
            raise ConfigurationError("wait='suspend' needs a saved stack (the job watcher loads it by name): save it "
                                     "with `gpuferry stack apply FILE` and pass it, or its name")  # fmt: skip
        return name
    return stack or ""


def preflight(blocks: Stack, run: RunPlan) -> None:
    """Every check of the stack and the run before anything is acquired or submitted: first those that need no
    outside call, so that a mistake in the stack is reported before any host is contacted; then the compute
    backend's check of the job, which may ask its cluster (a Slurm partition, the container runtime). The
    serving backend's checks against its cluster follow (``serving_preflight``)."""
    image = preflight_image(blocks, run)
    blocks.compute.check_store(blocks.storage)  # a model the cluster writes must reach the stack's store
    blocks.compute.check_tracking(blocks.tracking.tracking_uri)  # and its jobs must reach the tracking server
    check_images_for_serving(blocks)
    if blocks.images.produces_image and run.workload.definition.image is None:
        raise ConfigurationError(
            f"stack.images ({type(blocks.images).__name__}) builds the workload's image, but {run.workload.root}/"
            "gpuferry.yaml has no image section: add one (dockerfile, base + requirements, or prebuilt)"
        )
    blocks.serving.validate(run.serving)
    blocks.compute.validate_job(run.job("preflight", "/nonexistent", image, env={},
                                        secret_env=blocks.tracking.job_secrets()))  # fmt: skip


def check_images_for_serving(blocks: Stack) -> None:
    """A serving backend that runs containers needs a stack that builds the image it runs."""
    if blocks.serving.needs_image and not blocks.images.produces_image:
        raise ConfigurationError(
            f"stack.serving ({type(blocks.serving).__name__}) runs the workload's container image, but "
            f"stack.images ({type(blocks.images).__name__}) builds none: choose an image builder that pushes "
            "one (DockerImageBuilder) in the stack"
        )


def preflight_image(blocks: Stack, run: RunPlan) -> ImageRef | None:
    """A stand-in for the image the build step will pin, when the stack builds one: the job then runs
    inside it, so that path is checked (a container runtime, not shipped code, is needed)."""
    if not blocks.images.produces_image:
        return None
    return ImageRef(builder="preflight", content_tag="preflight", reference=f"preflight/image@sha256:{'0' * 64}",
                    workdir=run.workload.image_workdir())  # fmt: skip


def run_tags(blocks: Stack, image: ImageRef, run_key: str, run: RunPlan) -> dict[str, str]:
    tags = {f"backend.{step}": slug for step, slug in blocks.backends().items()}
    tags.update(run.workload.run_tags())
    tags.update({
        "gpuferry.git_sha": git_sha(), "prefect.flow_run_id": run_key,
        "image": image.reference or image.note, "image.content_tag": image.content_tag,
        "image.built": str(image.built).lower(), "image.note": image.note,
    })  # fmt: skip
    return tags


def git_sha() -> str:
    """The commit of gpuferry itself (the workload's own commit is tagged separately): the checkout's, or, for a
    package installed from a git URL (``uv tool install git+...``), the commit the installer recorded."""
    root = Path(__file__).resolve().parent.parent
    try:
        top, sha = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                                  text=True, timeout=10, check=True).stdout.split()  # fmt: skip
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
