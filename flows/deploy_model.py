"""Serve a registered model version: the registry says which version and where its checkpoint is.

Triggered by the ``mlflow.model_version.alias_set`` event (see ``deployments/webhook.py`` and
``deployments/poll_registry.py``), from the UI, or by hand. Deploying the version that already serves
changes nothing, so a repeated event is harmless. The serving image is the stack's image builder's
(content-addressed: an unchanged workload is not rebuilt). The outcome (deployed, rolled back and
why, failed) is recorded as ``deploy.*`` tags on the model version and on its source run.
"""

from __future__ import annotations

import json
from urllib.parse import urlparse

from prefect import flow, get_run_logger

from blocks.base.serving import Release
from blocks.errors import ConfigurationError
from blocks.plan import (
    IMAGE_TAG,
    IMAGE_WORKDIR_TAG,
    INPUT_EXAMPLE_TAG,
    SERVER_TAG,
    SERVICE_TAG,
    SERVING_TAG,
    check_images_for_serving,
    server_of,
)
from blocks.records import Endpoint, ImageRef, ServerSpec
from blocks.specs import ServingShape, ServingSpec
from blocks.stack import Stack, load_stack, saved_name
from flows.ship import deploy_and_record
from tasks.build import build_image
from tasks.provision import with_host_gpus
from tasks.registry import resolve_version, version_tags
from tasks.upload import model_serving_example
from tasks.waiting import RUN_STACK_LABEL, label_run
from tasks.workload import load

# What the serving backends can load (runtime/contract.py: MODEL_URI).
SERVABLE_SCHEMES = ("file", "s3")


@flow(name="deploy-model", log_prints=True)
def deploy_model(
    model_name: str,
    version: str | None = None,
    alias: str | None = "champion",
    stack: Stack | str | None = None,
    serving: ServingSpec = ServingSpec(),
    skip_if_moved: bool = False,
    workload: str | None = None,
) -> Endpoint | None:
    """Deploy ``model_name`` at ``version`` (or the version ``alias`` points at) on the stack's serving backend.

    A version that gpuferry registered says how it is served (service name, server, the image it was
    trained in, the service's shape: replicas, GPUs, CPU and memory); the smoke request is the model's own
    serving input example.

    Args:
        model_name: registered model name in the stack's MLflow registry.
        version: the version to deploy; empty: the version ``alias`` points at.
        alias: registry alias used when ``version`` is empty.
        stack: a saved ``Stack`` block, or its name (empty: embedded).
        serving: how the inference service runs; each field it sets overrides what the version recorded (a
            rollback by hand serves the older version as it was registered unless this says otherwise).
        skip_if_moved: with both ``version`` and ``alias`` given, deploy nothing when the alias no
            longer points at ``version`` (an event that arrives after a newer one is stale).
        workload: the workload to take the server and the image from, for a version registered without
            gpuferry (empty: what the version records).
    """
    if not model_name or not model_name.strip():
        raise ConfigurationError("model_name is empty: give the registered model's name")
    if not version and not alias:
        raise ConfigurationError("version and alias are both empty: give one of them")
    blocks = load_stack(stack)
    label_run({RUN_STACK_LABEL: saved_name(stack)})
    check_images_for_serving(blocks)
    blocks = with_host_gpus(blocks)  # a Docker host chooses the server's GPUs from its provider's inventory

    if skip_if_moved and version and alias:
        current, _ = resolve_version(blocks.tracking, model_name, None, alias)
        if current != str(version):
            get_run_logger().info(
                "%s: alias %r now points at v%s, not v%s: this event is stale, nothing deployed",
                model_name,
                alias,
                current,
                version,
            )
            return None
    resolved, source = resolve_version(blocks.tracking, model_name, version or None, alias or None)
    check_source(model_name, resolved, source)
    tags = version_tags(blocks.tracking, model_name, resolved)
    recorded = tags.get(IMAGE_TAG)
    work = load(workload) if workload else None
    if work is None and tags.get("gpuferry.workload.source") and _needs_workload(tags, recorded):
        work = load(tags["gpuferry.workload.source"])
    if recorded:  # the image the version was trained in and registered with
        image = ImageRef(builder="recorded", content_tag="", reference=recorded, workdir=tags.get(IMAGE_WORKDIR_TAG))
    elif work is not None:
        image = build_image(blocks.images, work)
    else:
        image = ImageRef(builder="none", content_tag="", note="no image recorded on the version")
    server = _server(tags, work, image)
    service = (
        serving.service_name or tags.get(SERVICE_TAG) or (work.definition.service_name if work else None) or model_name
    )
    # The shape the version recorded (else its workload's), and over it what this run's serving sets.
    declared = (
        ServingShape.model_validate_json(tags[SERVING_TAG])
        if tags.get(SERVING_TAG)
        else (work.definition.serve.shape() if work else None)
    )
    spec = serving.over(declared).model_copy(update={"service_name": service})
    blocks.serving.validate(spec)
    smoke = spec.smoke_request or model_serving_example(blocks.storage, source)
    if smoke is None and INPUT_EXAMPLE_TAG in tags:
        smoke = json.loads(tags[INPUT_EXAMPLE_TAG])
    if smoke is None and work is not None:
        smoke = work.definition.serve.input_example
    if smoke is None:
        raise ConfigurationError(
            f"{model_name} v{resolved} has no serving input example and none is given: the deploy gate needs a "
            "request the new version must answer; pass serving.smoke_request"
        )
    release = Release(
        model_name=model_name,
        version=resolved,
        model_uri=source,
        image=image if image.reference else None,
        server=server,
        checkpoint_sha256=tags.get("checkpoint_sha256"),
        store_env=blocks.storage.reader_env(),
    )
    endpoint = deploy_and_record(blocks, spec.model_copy(update={"smoke_request": smoke}), release)
    if endpoint.detail.get("changed") is False:
        get_run_logger().info("%s v%s already serves at %s: nothing changed", model_name, resolved, endpoint.url)
    return endpoint


def _needs_workload(tags: dict[str, str], image: str | None) -> bool:
    """Whether the version's own record is not enough to serve it: no server recorded, or the workload's own
    server run from the workload's directory (no image)."""
    if SERVER_TAG not in tags:
        return True
    return bool(ServerSpec.model_validate_json(tags[SERVER_TAG]).command) and not image


def _server(tags: dict[str, str], work: object, image: ImageRef) -> ServerSpec:
    """What serves the version: as recorded on it, else its workload's, else gpuferry's MLflow model server."""
    from blocks.workload.source import Workload

    if isinstance(work, Workload):
        return server_of(work, image)
    if SERVER_TAG in tags:
        server = ServerSpec.model_validate_json(tags[SERVER_TAG])
        if server.command and image.reference:
            server = server.model_copy(update={"workdir": image.workdir})
        return server
    return ServerSpec()


def check_source(model_name: str, version: str, source: str) -> None:
    """The version's source must be a checkpoint URI the serving backends can load."""
    scheme = urlparse(source).scheme
    if scheme not in SERVABLE_SCHEMES:
        raise ConfigurationError(
            f"{model_name} v{version} has source {source!r}: not a stored checkpoint "
            f"({', '.join(s + '://' for s in SERVABLE_SCHEMES)}); register versions with the retrain flow "
            "or with source= the checkpoint's URI"
        )
