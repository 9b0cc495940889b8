"""The serving steps: read-only checks before a pipeline trains, and the deploy itself."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from blocks.base.serving import DeployOutcome, Release, ServingBackend
from blocks.records import Endpoint
from blocks.specs import ServingSpec
from tasks.retry import retry_options


@task(name="serving-preflight", **retry_options())
def serving_preflight(serving: ServingBackend, spec: ServingSpec) -> None:
    """Can the backend serve ``spec`` (a Kubernetes namespace, a node with the GPU or MIG resource)? Read-only."""
    serving.preflight(spec)


@task(name="deploy", **retry_options(retries=3))
def deploy(serving: ServingBackend, spec: ServingSpec, release: Release) -> Endpoint:
    """Bring up the new version; traffic moves only once it is ready and answered a smoke prediction."""
    key = f"deploy-{spec.service.lower()}"
    try:
        endpoint = serving.deploy(spec, release)
    except Exception as exc:
        outcome = DeployOutcome.from_error(release, exc)
        create_markdown_artifact(key=key, markdown=outcome.markdown(), description="Outcome of the deploy step")
        raise
    outcome = DeployOutcome.deployed(release, endpoint)
    get_run_logger().info("%s", outcome.markdown().replace("**", ""))
    create_markdown_artifact(key=key, markdown=outcome.markdown(), description="Outcome of the deploy step")
    return endpoint
