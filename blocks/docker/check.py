"""The checks of the Docker backends: the image builder's engine and registry (``DockerImageBuilder``), and the
host that trains or serves (``DockerCompute``, ``DockerServing``: the engine answers, and the GPUs it offers).

Clients are made here with the probe's deadline as their timeout and no retries of their own: a check says at
once what does not answer instead of retrying it for minutes as a pipeline step would.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from blocks.checks import Probe, reach_url
from blocks.docker.gpu_alloc import describe_inventory
from blocks.docker.spec import LABEL_KIND, LABEL_SERVICE

if TYPE_CHECKING:
    from blocks.docker.gpu_host import DockerGpuHost
    from blocks.docker.image import DockerImageBuilder


def check_docker_builder(builder: DockerImageBuilder, probe: Probe) -> None:
    """The engine answers, the registry takes the login, and the login may push to the repository (an upload
    is started and cancelled: nothing is stored)."""

    def engine() -> str:
        host = builder.docker_host.model_copy(update={"timeout": max(1, int(probe.left))})
        client = host.get_client()
        try:
            version = client.version()
        finally:
            client.close()
        name = (
            next(
                (c.get("Name", "") for c in version.get("Components", []) if "podman" in c.get("Name", "").lower()), ""
            )
            or "Docker Engine"
        )
        return (
            f"{name} {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at "
            f"{builder.docker_host.base_url or os.environ.get('DOCKER_HOST') or 'the default socket'}"
        )

    probe.step("engine", engine, "start the engine (Docker, or `podman system service`), or fix docker_host.base_url")
    registry_url = builder._registry_base_url()
    if not reach_url(probe, registry_url, "start the registry, or fix credentials.registry_url"):
        return
    from blocks.docker.registry import RegistryClient

    creds = builder.credentials
    client = RegistryClient(registry_url, creds.username, creds.password.get_secret_value(), timeout_s=probe.left)
    try:
        if not probe.step(
            "registry login", lambda: client.check_login(), "fix credentials.username / credentials.password"
        ):
            return
        probe.step(
            "push permission",
            lambda: client.check_push(builder.repository),
            f"grant {builder.credentials.username!r} push on {builder.repository}",
        )
    finally:
        client.close()


def check_docker_host(host: DockerGpuHost, probe: Probe, *, role: str) -> None:
    """The engine a ``DockerCompute`` or ``DockerServing`` block runs containers on answers (which engine, which
    API), the GPUs it offers and those gpuferry's containers hold, and, when the stack builds an image, that the
    engine is given a registry login to pull it with; a serving host lists the services it runs."""
    engine = host.model_copy(update={"request_timeout_seconds": max(1.0, probe.left)}).engine()
    try:

        def reach() -> str:
            version = engine.client.version()
            name = next(
                (c.get("Name", "") for c in version.get("Components", []) if "podman" in c.get("Name", "").lower()),
                "",
            )
            return (
                f"{name or 'Docker Engine'} {version.get('Version', '?')} at {engine.where} "
                f"({engine.api} API for containers)"
            )

        if not probe.step(
            "engine", reach, "start the engine (Docker, or `podman system service`), or fix docker_host.base_url"
        ):
            return

        def gpus() -> Any:
            mode = host.resolved_gpu_mode()
            held = sorted({gpu for claim, _ in engine.gpu_claims() for gpu in claim.gpus})
            in_use = f"in use by gpuferry's containers: {', '.join(held)}" if held else "none in use by gpuferry"
            inventory = host.inventory()
            if inventory is None:
                return (
                    f"known at run time (the provider's node reads them with nvidia-smi); {in_use}; GPUs reach "
                    f"containers by {mode}"
                )
            return f"{describe_inventory(inventory)}; {in_use}; GPUs reach containers by {mode}"

        probe.step("GPUs", gpus, "set gpu_mode (nvidia or cdi) and cdi_kind to what the host has")
        if probe.needs_image:
            credentials = host.registry_credentials
            if credentials is None:
                probe.info("registry login", "none: the engine pulls the workload's image without a login")
            else:
                from blocks.docker.registry import RegistryClient, registry_base_url

                registry = RegistryClient(
                    registry_base_url(credentials.registry_url, field="registry_credentials.registry_url"),
                    credentials.username,
                    credentials.password.get_secret_value(),
                    timeout_s=probe.left,
                )
                try:
                    probe.step(
                        "registry login",
                        registry.check_login,
                        "fix registry_credentials (username, password, registry_url): the engine pulls with them",
                    )
                finally:
                    registry.close()
        if role == "serving":

            def services() -> str:
                fronts = engine.containers({LABEL_KIND: "front"})
                names = sorted((c.get("Labels") or {}).get(LABEL_SERVICE, "?") for c in fronts)
                return f"{len(names)} service(s) here: {', '.join(names)}" if names else "no service here yet"

            probe.step("services", services)
    finally:
        engine.close()
