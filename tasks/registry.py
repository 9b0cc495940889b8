"""Read the model registry: which version to deploy and where its checkpoint is."""

from __future__ import annotations

from prefect import get_run_logger, task

from blocks.tracking.mlflow import MlflowTracking
from tasks.retry import retry_options


@task(name="resolve-version", **retry_options())
def resolve_version(
    tracking: MlflowTracking, model_name: str, version: str | None, alias: str | None
) -> tuple[str, str]:
    """``(version, checkpoint URI)``: the version given, else the one the alias points at."""
    resolved, source = tracking.resolve_version(model_name, version, alias)
    how = f"v{resolved}" if version else f"alias {alias!r} → v{resolved}"
    get_run_logger().info("%s %s: checkpoint %s", model_name, how, source)
    return resolved, source


@task(name="version-tags", **retry_options())
def version_tags(tracking: MlflowTracking, model_name: str, version: str) -> dict[str, str]:
    """The version's tags: how gpuferry serves it (service, server, image), which code made it."""
    return tracking.version_tags(model_name, version)
