"""Deploy a model version on the stack's serving backend."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from blocks.errors import DeployFailed
from blocks.serving import Release, ServingBackend
from blocks.specs import Endpoint, ServingSpec
from tasks.retry import retry_options


@task(name="deploy", **retry_options(retries=3))
def deploy(serving: ServingBackend, spec: ServingSpec, release: Release) -> Endpoint:
    """Bring up the new version; traffic moves only once it is ready and answered a smoke prediction."""
    key = f"deploy-{spec.service_name.lower()}"
    try:
        endpoint = serving.deploy(spec, release)
    except DeployFailed as exc:
        create_markdown_artifact(
            key=key, markdown=f"**{release.model_name} v{release.version} not deployed**\n\n```\n{exc}\n```",
            description="Outcome of the deploy step",
        )  # fmt: skip
        raise
    previous = f" (replaced v{endpoint.previous_version})" if endpoint.previous_version else ""
    get_run_logger().info("%s v%s serving at %s%s", release.model_name, release.version, endpoint.url, previous)
    create_markdown_artifact(
        key=key, markdown=f"**{release.model_name} v{release.version}** serves at {endpoint.url}{previous}",
        description="Outcome of the deploy step",
    )  # fmt: skip
    return endpoint
