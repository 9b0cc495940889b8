"""MLflow: the pipeline's run, the model version and its promotion."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from blocks.base.serving import DeployOutcome
from blocks.records import CheckpointRef, ModelVersionRef
from blocks.specs import PromotionPolicy
from blocks.tracking.mlflow import MlflowTracking
from tasks.retry import retry_options


@task(name="start-run", **retry_options())
def start_run(
    tracking: MlflowTracking, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str]
) -> str:
    """The pipeline's MLflow run (the same one when the flow run is retried)."""
    run_id = tracking.start_run(experiment, run_name, tags)
    tracking.log(run_id, params=params)
    return run_id


@task(name="log-run", **retry_options())
def log_run(
    tracking: MlflowTracking,
    run_id: str,
    *,
    params: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    tracking.log(run_id, params=params, metrics=metrics, tags=tags)


@task(name="run-metrics", **retry_options())
def run_metrics(tracking: MlflowTracking, run_id: str) -> dict[str, float]:
    return tracking.run_metrics(run_id)


@task(name="register-model", **retry_options())
def register_model(
    tracking: MlflowTracking,
    run_id: str,
    model_name: str,
    checkpoint: CheckpointRef,
    policy: PromotionPolicy,
    value: float,
    version_tags: dict[str, str] | None = None,
    move_alias: bool = True,
) -> ModelVersionRef:
    """Register the checkpoint as a new version; move the alias to it only if it beats the champion, and only
    now with ``move_alias`` (else its rollout moves it once live traffic judged it: ``set_alias``)."""
    logger = get_run_logger()
    assert policy.metric is not None  # filled in from the workload (blocks/plan.py)
    version = tracking.register(model_name, run_id, checkpoint, policy.metric, value, version_tags)
    champion = tracking.version_by_alias(model_name, policy.alias)
    champion_value = None
    if champion is not None and champion != version:
        champion_value = tracking.version_metric(model_name, champion, policy.metric)
    promoted = champion == version or policy.beats(value, champion_value)
    waits = promoted and champion != version and not move_alias
    if promoted and champion != version and move_alias:
        tracking.set_alias(model_name, policy.alias, version)
    verdict = "candidate" if waits else "promoted" if promoted else "not promoted"
    tracking.tag_version(model_name, version, {"promotion": verdict})
    logger.info(
        "%s v%s %s=%.4f vs %s %s: %s",
        model_name,
        version,
        policy.metric,
        value,
        policy.alias,
        f"v{champion} ({champion_value:.4f})" if champion_value is not None else "(none)",
        verdict,
    )
    return ModelVersionRef(
        name=model_name,
        version=version,
        run_id=run_id,
        source=checkpoint.uri,
        metric=policy.metric,
        value=value,
        promoted=promoted,
        champion_before=champion,
        champion_value=champion_value,
    )


@task(name="set-alias", **retry_options())
def set_alias(tracking: MlflowTracking, model_name: str, alias: str, version: str) -> None:
    """Move ``alias`` to ``version`` (its rollout passed) and tag it promoted."""
    tracking.set_alias(model_name, alias, version)
    tracking.tag_version(model_name, version, {"promotion": "promoted"})
    get_run_logger().info("%s v%s passed its rollout: %s points at it", model_name, version, alias)


@task(name="finish-run", **retry_options())
def finish_run(tracking: MlflowTracking, run_id: str, status: str = "FINISHED") -> None:
    tracking.end_run(run_id, status)


@task(name="record-deploy", **retry_options())
def record_deploy(tracking: MlflowTracking, outcome: DeployOutcome, runs: list[str] | None = None) -> list[str]:
    """The deploy's outcome as ``deploy.*`` tags on the model version, its source run and ``runs``."""
    return tracking.record_deploy(
        outcome.model_name, outcome.version, outcome.tags(), DeployOutcome.TAG_PREFIX, runs or []
    )
