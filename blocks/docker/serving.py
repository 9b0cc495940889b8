"""Serve on one Docker host (or podman): ``DockerServing``, a ``ServingBackend``.

A service is its front (``gpuferry-front-<service>``, ``runtime/front.py``), which publishes the service's
address — ``service_port`` on ``bind_address`` — and forwards each request to the version serving now, and
that version's container. Both are on one user-defined Docker network (``network``, made when missing),
whose DNS lets the front reach a version by a name of its own.

``deploy(spec, release)`` runs the server (gpuferry's MLflow model server, or the workload's own) from the
release's image, pinned by digest, as a new container next to the one that serves now:

1. GPUs are chosen as for training jobs (count, indices or UUIDs; never another container's unless both
   share), except that the new version may take over its predecessor's GPUs when too few others are free;
2. the container publishes its own port on ``bind_address`` at a port the engine picks (how the deploy checks
   it), with the engine's restart policy and health check; a ``file://`` model's directory is mounted read-only;
3. it must become ready (``readiness_path``) and answer the smoke request on that port; otherwise it is
   removed with the tail of its log in the error, and the previous version keeps serving, untouched;
4. then traffic moves: the front is told the new version's name (``docker exec``: every request that starts
   afterwards goes there, requests under way finish where they are), and must answer ``readiness_path``
   through to it (else the front goes back to the previous version, the new one is removed and the deploy
   fails); the service's container name (``gpuferry-serve-<service>``) passes to the new container, and the
   previous one drains (SIGTERM, ``drain_seconds``) and is removed.

The first deploy makes the front (from the release's image: any image gpuferry builds has its runtime); a
front that is gone, stopped, or on another network or port than the block says is made again. The
endpoint is the front's address, the same for every version. Deploying the version that already serves
changes nothing.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlparse

from pydantic import Field

from blocks.base.analysis import decided
from blocks.base.backoff import wait_until
from blocks.base.secrets import check_env_names, write_secret_env
from blocks.base.serving import Release, ServingBackend, is_ready, release_image, require_smoke_request, smoke_test
from blocks.checks import CheckRow, Probe
from blocks.docker.canary import DockerCanary
from blocks.docker.front import DockerFront
from blocks.docker.gpu_alloc import GpuRequest, HostGpu, claim_label
from blocks.docker.gpu_host import DockerGpuHost
from blocks.docker.spec import (
    DEFAULT_NETWORKS,
    FRONT_PORT_IN_CONTAINER,
    LABEL_FRONT_TARGET,
    LABEL_GPU_SHARING,
    LABEL_GPUS,
    LABEL_KIND,
    LABEL_MODEL_NAME,
    LABEL_MODEL_URI,
    LABEL_MODEL_VERSION,
    LABEL_PORT,
    LABEL_READINESS,
    LABEL_SERVICE,
    HealthCheck,
    container_name,
    http_probe,
    server_container,
)
from blocks.errors import CanaryFailed, ConfigurationError, DeployFailed
from blocks.home import gpuferry_home
from blocks.records import Endpoint
from blocks.specs import ServingSpec
from runtime import contract

# How long a deploy that saw its new container exit or restart waits to see the exit code of the failed run.
RESTARTED_EXIT_WAIT_S = 10.0


class DockerServing(DockerFront, DockerCanary, ServingBackend, DockerGpuHost):
    """Serves the model as a container on one Docker host; a new version takes traffic once it answers (and,
    with a canary rollout, once it passed its window)."""

    needs_image: ClassVar[bool] = True
    rollout_strategies: ClassVar[tuple[str, ...]] = ("rolling", "canary", "shadow")

    _block_type_name = "gpuferry Docker Serving"
    _description = (
        "Serves the model as a container on one Docker host (or podman): GPUs by count, index or UUID, restart "
        "policy, health check; a new version takes over only once it is ready and answered the smoke request."
    )

    bind_address: str = Field(
        "127.0.0.1", description="Host address the server's port is published on (0.0.0.0: every address)."
    )
    advertise_host: str | None = Field(
        None,
        description="Host name in the endpoint's URL (None: the engine's host: 127.0.0.1 for a local socket, "
        "the host of a tcp:// or ssh:// base_url; bind_address when it names one address).",
    )
    network: str = Field(
        "gpuferry-serving",
        description="Docker network of the service's versions and its front: a user-defined "
        "bridge (made when missing), whose DNS lets the front reach a version by name. Not host, none or the "
        "engine's default bridge, where no container name resolves.",
    )
    service_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="The service's port on bind_address: its front publishes it and forwards "
        "each request to the version serving now, so the address outlives versions. None: a port the engine picks "
        "when the front is made, kept as long as the front exists.",
    )
    front_ready_seconds: float = Field(
        60.0,
        gt=0,
        description="How long a new or switched front may take to answer readiness_path through to the "
        "new version before the deploy fails (and the previous version keeps serving).",
    )
    container_port: int = Field(
        8080,
        ge=1,
        le=65535,
        description="Port gpuferry's model server listens on inside (a workload's own server: its serve.port).",
    )
    restart_policy: Literal["no", "on-failure", "always", "unless-stopped"] = Field(
        "unless-stopped", description="The engine restarts the server when it exits (and after the engine restarts)."
    )
    restart_max_retries: int = Field(5, ge=0, description="With restart_policy=on-failure: how many restarts at most.")
    health_check: bool = Field(
        True,
        description="The engine's own health check (GET health_path from inside, with the image's Python): "
        "gpuferry's server always has one; a workload's own server when health_command is set.",
    )
    health_command: list[str] | None = Field(
        None,
        description="The health check's argv inside the container (None: a Python GET of health_path).",
    )
    health_interval_seconds: float = Field(10.0, gt=0, description="Seconds between two health checks.")
    memory_limit_gb: float | None = Field(None, gt=0, description="Memory limit of the server (None: none).")
    env: dict[str, str] = Field(default_factory=dict, description="More variables of the server (not secrets).")
    pass_env: list[str] = Field(
        default_factory=lambda: [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL",
            "AWS_DEFAULT_REGION",
            "AWS_CA_BUNDLE",
        ],
        description="Names of this process's variables the server gets (what an s3:// model URI needs), their values "
        "through a 0600 file on the host mounted read-only, never in the container's configuration.",
    )
    mounts: dict[str, str] = Field(
        default_factory=dict, description="Host directories mounted read-only, host path -> path in the container."
    )
    state_dir: str | None = Field(
        None,
        description="Where the 0600 files of pass_env are written: a directory the Docker host sees at the "
        "same path (None: $GPUFERRY_HOME/serving-docker).",
    )
    drain_seconds: int = Field(30, ge=1, description="How long the old version may take to drain before SIGKILL.")

    # ---- checks ------------------------------------------------------------------------------

    @staticmethod
    def gpu_request(spec: ServingSpec) -> GpuRequest:
        return GpuRequest(count=spec.gpus, devices=tuple(spec.gpu_devices), share=spec.share_gpus)

    def validate(self, spec: ServingSpec) -> None:  # type: ignore[override]  # pydantic v1's BaseModel.validate, unused
        if spec.mig_profile:
            raise ConfigurationError(
                f"mig_profile={spec.mig_profile!r}: the Docker backend gives whole GPUs; use a "
                "Kubernetes stack with the MIG device plugin for slices"
            )
        if spec.replicas != 1:
            raise ConfigurationError(f"replicas={spec.replicas}: Docker serving runs one replica; set replicas=1")
        if self.network in DEFAULT_NETWORKS:
            raise ConfigurationError(
                f"network={self.network!r}: the service's front reaches its versions by name, which the engine's "
                "own networks do not resolve (and a new version listens next to the old one); use a user-defined "
                "network: gpuferry-serving (the default, made when missing) or one of yours"
            )
        check_env_names([*self.pass_env, *self.env], "pass_env/env")
        for host, target in self.mounts.items():
            if not host.startswith("/") or not target.startswith("/"):
                raise ConfigurationError(f"mounts {host!r}: {target!r}: both must be absolute paths")
        self.check_gpu_request(self.gpu_request(spec), required=False)

    def preflight(self, spec: ServingSpec) -> None:
        """``validate``, and the engine answers (which API it speaks)."""
        self.validate(spec)
        self.resolved_gpu_mode()

    # ---- deploy ------------------------------------------------------------------------------

    def active_name(self, service: str) -> str:
        return container_name("gpuferry-serve", service)

    def front_name(self, service: str) -> str:
        return container_name("gpuferry-front", service)

    def deploy(self, spec: ServingSpec, release: Release) -> Endpoint:
        self.validate(spec)
        image = release_image(release.image.reference if release.image else None, "DockerServing")
        service, engine = spec.service, self.engine()
        active = self.active_name(service)
        previous = engine.inspect(active)
        if previous is not None and previous["State"]["Status"] != "running":
            previous = None  # stopped by hand: nothing serves, so nothing drains
        if previous is not None:
            labels = previous["Config"].get("Labels") or {}
            url = self._url(previous)
            target, readiness = labels.get(LABEL_FRONT_TARGET), labels.get(LABEL_READINESS, "/readyz")
            if (
                labels.get(LABEL_MODEL_VERSION) == release.version
                and labels.get(LABEL_MODEL_URI) == release.model_uri
                and target
                and url
                and is_ready(url, readiness)
            ):
                front = self._route(service, target, previous["Config"]["Image"], readiness, restore=None)
                return self._endpoint(
                    spec, release.version, previous, front, url, previous_version=release.version, changed=False
                )
        smoke = require_smoke_request(spec)
        request = self.gpu_request(spec)
        inventory = self.check_gpu_request(request, required=True)
        restore = None if previous is None else (previous["Config"].get("Labels") or {}).get(LABEL_FRONT_TARGET)
        if restore:
            self._end_stale_window(service, restore)  # before the leftovers it may still send requests to go
        self._remove_leftovers(service, keep={active})
        engine.ensure_image(image, self.registry_credentials)
        gpu_mode = self.resolved_gpu_mode() if request.wanted else "cdi"
        engine.ensure_network(self.network, {LABEL_KIND: "network"})
        suffix = uuid.uuid4().hex[:6]
        candidate = container_name("gpuferry-serve", service, f"v{release.version}", suffix)
        alias = container_name(f"v{release.version}", suffix, service)[:63].rstrip("-.")  # a DNS label: 63 at most
        secret_file = self._write_secrets(candidate)

        def build(gpus: list[HostGpu]) -> Any:
            return self._container(spec, release, image, candidate, alias, gpus, request, gpu_mode, secret_file)

        def own(summary: dict[str, Any]) -> bool:  # the service's containers: the new version may take their GPUs
            return (summary.get("Labels") or {}).get(LABEL_SERVICE) == service

        try:
            container, gpus = engine.create_with_gpus(inventory, request, build, yielding=own, host=self.host_label)
        except BaseException:
            self._forget_secrets(candidate)
            raise
        measured: dict[str, Any] = {}
        try:
            engine.start(container)
            info = self._wait_ready(container, release, spec.ready_timeout_seconds)
            url = self._url(info)
            assert url is not None  # _wait_ready returns once the server's port is published and it answers
            smoke_test(url, release.server, smoke)
            target = f"{alias}:{self._port(release)}"
            rollout = spec.rollout
            if rollout is not None and rollout.strategy != "rolling" and previous is not None and restore:
                old_url = self._url(previous)
                if old_url is None:
                    raise DeployFailed(f"v{_version(previous)} of {service} has no published port to judge it by")
                readiness = (previous["Config"].get("Labels") or {}).get(LABEL_READINESS, "/readyz")
                self._route(service, restore, previous["Config"]["Image"], readiness, restore=None)  # the front fits
                measured = self._canary(
                    service,
                    rollout,
                    serving=(_version(previous) or "?", restore, old_url),
                    candidate=(release.version, target, url, container),
                )
            front = self._route(service, target, image, release.server.readiness_path, restore=restore)
            if measured:
                decided(measured)  # the front answers through the new version alone: the verdict is applied
        except BaseException as exc:
            tail = engine.tail(container, 30) or ""
            engine.remove(container)
            self._forget_secrets(candidate)
            if isinstance(exc, CanaryFailed):
                raise
            if isinstance(exc, (DeployFailed, ConfigurationError)):
                kept = f"v{_version(previous)} keeps serving" if previous else "nothing else serves"
                raise DeployFailed(
                    f"v{release.version} of {service} was removed, {kept}: {exc}\n--- last lines of its log ---\n{tail}"
                ) from exc
            raise
        self._switch(previous, container, active)
        if previous is not None:
            engine.stop(previous["Id"], timeout=self.drain_seconds)
            engine.remove(previous["Id"])
            self._forget_secrets(previous["Name"].lstrip("/"))
        info = engine.inspect(container) or info
        endpoint = self._endpoint(
            spec, release.version, info, front, url, previous_version=_version(previous) if previous else None
        )
        if measured:
            endpoint.detail["rollout"] = measured
        return endpoint

    def _port(self, release: Release) -> int:
        """The port the server listens on inside its container."""
        return self.container_port if release.server.mlflow_server else release.server.port

    def _container(
        self,
        spec: ServingSpec,
        release: Release,
        image: str,
        name: str,
        alias: str,
        gpus: list[HostGpu],
        request: GpuRequest,
        gpu_mode: str,
        secret_file: str | None,
    ) -> Any:
        server = release.server
        port = self._port(release)
        env = {
            **server.env,
            contract.MODEL_URI: release.model_uri,
            contract.MAX_BATCH_SIZE: str(spec.max_batch_size),
            contract.MAX_BATCH_WAIT_MS: str(spec.max_batch_wait_ms),
            contract.MAX_QUEUE: str(spec.max_queue),
            **({contract.MODEL_SHA256: release.checkpoint_sha256} if release.checkpoint_sha256 else {}),
            **self.env,
        }
        labels = {
            LABEL_KIND: "server",
            LABEL_SERVICE: spec.service,
            LABEL_MODEL_NAME: release.model_name,
            LABEL_MODEL_VERSION: release.version,
            LABEL_MODEL_URI: release.model_uri,
            LABEL_PORT: str(port),
            LABEL_READINESS: server.readiness_path,
            LABEL_FRONT_TARGET: f"{alias}:{port}",
        }
        if gpus:
            labels.update({LABEL_GPUS: claim_label(gpus), LABEL_GPU_SHARING: str(request.share).lower()})
        health = None
        if self.health_check and (server.mlflow_server or self.health_command):
            command = tuple(self.health_command or http_probe(port, server.health_path))
            health = HealthCheck(
                command,
                interval_s=self.health_interval_seconds,
                timeout_s=3,
                retries=3,
                start_period_s=spec.ready_timeout_seconds,
            )
        parsed = urlparse(release.model_uri)
        model_dir = unquote(parsed.path) if parsed.scheme == "file" else None
        return server_container(
            name=name,
            image=image,
            command=server.command,
            port=port,
            env=env,
            labels=labels,
            workdir=None if server.mlflow_server else server.workdir,
            gpus=self.device_ids(gpus, request, gpu_mode) if gpus else (),
            gpu_count=len(gpus),
            gpu_mode=gpu_mode,
            model_dir=model_dir,
            mounts=self.mounts,
            network=self.network,
            aliases=(alias,),
            bind_address=self.bind_address,
            restart_policy=self.restart_policy,
            restart_retries=self.restart_max_retries,
            healthcheck=health,
            memory_mb=_memory_mb(spec.memory_limit)
            or (None if self.memory_limit_gb is None else int(self.memory_limit_gb * 1024)),
            stop_timeout_s=self.drain_seconds,
            secret_file=secret_file,
        )

    def _wait_ready(self, container: str, release: Release, timeout: float) -> dict[str, Any]:
        engine = self.engine()
        seen: dict[str, Any] = {}

        def ready() -> bool:
            info = engine.inspect(container)
            if info is None:
                raise DeployFailed(f"the container of v{release.version} vanished before it was ready")
            seen["info"] = info
            state = info["State"]
            restarts = int(info.get("RestartCount") or 0)
            status = state["Status"]
            if status in ("exited", "dead", "restarting") or restarts > 0:
                final = status in ("exited", "dead")  # its exit code is the failed run's
                if state.get("ExitCode"):
                    seen["exit_code"] = state["ExitCode"]
                # Under a restart policy the engine may already show the next run (exit code 0): the failed
                # run's code shows when it exits again, which a server that cannot start does at once.
                first = seen.setdefault("failed_at", time.monotonic())
                if not final and "exit_code" not in seen and time.monotonic() - first < RESTARTED_EXIT_WAIT_S:
                    return False
                code = seen.get("exit_code", state.get("ExitCode") if final else None)
                what = f"exit code {code}" if code is not None else f"restarted {restarts}x, exit code not seen"
                raise DeployFailed(
                    f"the server of v{release.version} exited ({what}"
                    f"{', OOMKilled' if state.get('OOMKilled') else ''}) before it was ready"
                )
            url = self._url(info)
            return state["Status"] == "running" and url is not None and is_ready(url, release.server.readiness_path)

        if not wait_until(ready, timeout, first=0.1, most=1.0):
            raise DeployFailed(f"v{release.version} was not ready within {timeout:.0f} s (ready_timeout_seconds)")
        return seen["info"]

    def _switch(self, previous: dict[str, Any] | None, container: str, active: str) -> None:
        """Traffic moves: the service's name passes to the new container."""
        engine = self.engine()
        if previous is not None:
            engine.rename(previous["Id"], container_name(active, "retired", uuid.uuid4().hex[:6]))
        try:
            engine.rename(container, active)
        except BaseException:
            if previous is not None:
                engine.rename(previous["Id"], active)
            raise

    def _remove_leftovers(self, service: str, keep: set[str]) -> None:
        """Containers of the service that are not the one serving: candidates of a deploy that stopped halfway."""
        engine = self.engine()
        for summary in engine.containers({LABEL_SERVICE: service, LABEL_KIND: "server"}):
            name = str((summary.get("Names") or [""])[0]).lstrip("/")
            if name not in keep:
                engine.remove(summary["Id"])
                self._forget_secrets(name)

    # ---- secrets -----------------------------------------------------------------------------

    def _secrets_dir(self) -> Path:
        path = Path(self.state_dir) if self.state_dir else gpuferry_home() / "serving-docker"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _write_secrets(self, name: str) -> str | None:
        values = {key: os.environ[key] for key in self.pass_env if key in os.environ}
        if not values:
            return None
        path = self._secrets_dir() / f"{name}.env"
        write_secret_env(path, values)
        return str(path)

    def _forget_secrets(self, name: str) -> None:
        (self._secrets_dir() / f"{name}.env").unlink(missing_ok=True)

    # ---- what serves -------------------------------------------------------------------------

    def _url(self, info: dict[str, Any], port: int | None = None) -> str | None:
        """Where the container's ``port`` (a server's: its own) is published, as clients reach it."""
        labels = info["Config"].get("Labels") or {}
        ports = (info.get("NetworkSettings") or {}).get("Ports") or {}
        bound = ports.get(f"{port or labels.get(LABEL_PORT, self.container_port)}/tcp") or []
        if not bound or not bound[0].get("HostPort"):
            return None
        host = self.advertise_host
        if host is None:
            host = (
                self.bind_address
                if self.bind_address not in ("0.0.0.0", "::", "127.0.0.1")
                else self.engine().host_name
            )
        return f"http://{host}:{bound[0]['HostPort']}"

    def services(self) -> list[str]:
        engine = self.engine()
        names = {(c.get("Labels") or {}).get(LABEL_SERVICE) for c in engine.containers({LABEL_KIND: "server"})}
        return sorted(n for n in names if n and self.current(n) is not None)

    def current(self, service: str) -> dict[str, Any] | None:
        """What serves ``service``: its version, ``url`` (the front's address; None when no front runs),
        ``version_url`` (the version's own port), container, image, GPUs, health."""
        engine = self.engine()
        info = engine.inspect(self.active_name(service))
        if info is None or info["State"]["Status"] != "running":
            return None
        labels = info["Config"].get("Labels") or {}
        front = engine.inspect(self.front_name(service))
        url = self._url(front, FRONT_PORT_IN_CONTAINER) if front and front["State"]["Status"] == "running" else None
        return {
            "version": labels.get(LABEL_MODEL_VERSION),
            "model_uri": labels.get(LABEL_MODEL_URI),
            "model_name": labels.get(LABEL_MODEL_NAME),
            "url": url,
            "version_url": self._url(info),
            "container": info["Name"].lstrip("/"),
            "image": info["Config"].get("Image"),
            "gpus": labels.get(LABEL_GPUS, ""),
            "health": (info["State"].get("Health") or {}).get("Status"),
            "started": info["State"].get("StartedAt"),
        }

    def undeploy(self, service: str) -> bool:
        engine = self.engine()
        running = False
        for summary in engine.containers({LABEL_SERVICE: service, LABEL_KIND: "server"}):
            running = running or summary.get("State") == "running"
            engine.stop(summary["Id"], timeout=self.drain_seconds)
            engine.remove(summary["Id"])
            self._forget_secrets(str((summary.get("Names") or [""])[0]).lstrip("/"))
        for summary in engine.containers({LABEL_SERVICE: service, LABEL_KIND: "front"}):
            engine.remove(summary["Id"])
        return running

    def _endpoint(
        self,
        spec: ServingSpec,
        version: str,
        info: dict[str, Any],
        url: str,
        version_url: str | None,
        *,
        previous_version: str | None,
        changed: bool = True,
    ) -> Endpoint:
        labels = info["Config"].get("Labels") or {}
        return Endpoint(
            service=spec.service,
            url=spec.url or url,
            model_version=version,
            backend=self.get_block_type_slug(),
            previous_version=previous_version,
            detail={
                "changed": changed,
                "container": self.active_name(spec.service),
                "host": self.host_label,
                "gpus": labels.get(LABEL_GPUS, ""),
                "started": time.time(),
                "version_url": version_url or "",
                "front": self.front_name(spec.service),
            },
        )

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The engine, the GPUs it offers and those in use, the login it pulls images with, the services it runs
        (``check.py``)."""
        from blocks.docker.check import check_docker_host

        check_docker_host(self, probe, role="serving")
        return probe.rows


def _version(info: dict[str, Any] | None) -> str | None:
    return None if info is None else (info["Config"].get("Labels") or {}).get(LABEL_MODEL_VERSION)


def _memory_mb(quantity: str | None) -> int | None:
    """A Kubernetes memory quantity ('4Gi', '512Mi', '2G') in MiB, for the engine's memory limit."""
    if quantity is None:
        return None
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    number, unit = quantity, ""
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            number, unit = quantity[: -len(suffix)], suffix
            break
    return max(1, int(float(number) * units.get(unit, 1) / 2**20))
