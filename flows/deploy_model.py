"""Serve a registered model version: the registry says which version and where its checkpoint is.

Triggered by the ``mlflow.model_version.alias_set`` event (see ``deployments/webhook.py`` and
``deployments/poll_registry.py``), from the UI, or by hand. Deploying the version that already serves
changes nothing, so a repeated event is harmless. The serving image is the stack's image builder's
(content-addressed: an unchanged workload is not rebuilt). The outcome (deployed, rolled back and
why, failed) is recorded as ``deploy.*`` tags on the model version and on its source run.
"""

from __future__ import annotations

from urllib.parse import urlparse

from prefect import flow, get_run_logger

from blocks.errors import ConfigurationError
from blocks.serving import Release
from blocks.specs import Endpoint, ServingSpec
from flows.retrain import check_images_for_serving, load_stack
from flows.ship import deploy_and_record
from tasks.build import build_image
from tasks.registry import resolve_version

# What the serving backends can load (workload/contract.py: MODEL_URI).
SERVABLE_SCHEMES = ("file", "s3")


@flow(name="deploy-model", log_prints=True)
def deploy_model(
    model_name: str,
    version: str | None = None,
    alias: str | None = "champion",
    stack: str | None = None,
    serving: ServingSpec = ServingSpec(),
    skip_if_moved: bool = False,
) -> Endpoint | None:
    """Deploy ``model_name`` at ``version`` (or the version ``alias`` points at) on the stack's serving backend.

    Args:
        model_name: registered model name in the stack's MLflow registry.
        version: the version to deploy; empty: the version ``alias`` points at.
        alias: registry alias used when ``version`` is empty.
        stack: name of a saved ``Stack`` block (empty: embedded).
        serving: how the inference service runs.
        skip_if_moved: with both ``version`` and ``alias`` given, deploy nothing when the alias no
            longer points at ``version`` (an event that arrives after a newer one is stale).
    """
    if not model_name or not model_name.strip():
        raise ConfigurationError("model_name is empty: give the registered model's name")
    if not version and not alias:
        raise ConfigurationError("version and alias are both empty: give one of them")
    blocks = load_stack(stack)
    check_images_for_serving(blocks)
    blocks.serving.validate(serving)

    if skip_if_moved and version and alias:
        current, _ = resolve_version(blocks.tracking, model_name, None, alias)
        if current != str(version):
            get_run_logger().info(
                "%s: alias %r now points at v%s, not v%s: this event is stale, nothing deployed",
                model_name, alias, current, version,
            )  # fmt: skip
            return None
    resolved, source = resolve_version(blocks.tracking, model_name, version or None, alias or None)
    check_source(model_name, resolved, source)
    image = build_image(blocks.images)
    release = Release(
        model_name=model_name, version=resolved, model_uri=source, image=image if image.reference else None
    )
    endpoint = deploy_and_record(blocks, serving, release)
    if endpoint.detail.get("changed") is False:
        get_run_logger().info("%s v%s already serves at %s: nothing changed", model_name, resolved, endpoint.url)
    return endpoint


def check_source(model_name: str, version: str, source: str) -> None:
    """The version's source must be a checkpoint URI the serving backends can load."""
    scheme = urlparse(source).scheme
    if scheme not in SERVABLE_SCHEMES:
        raise ConfigurationError(
            f"{model_name} v{version} has source {source!r}: not a stored checkpoint "
            f"({', '.join(s + '://' for s in SERVABLE_SCHEMES)}); register versions with the retrain flow "
            "or with source= the checkpoint's URI"
        )
