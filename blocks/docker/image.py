"""Build the workload's image with a Docker engine (or podman's Docker API), push it, pin it by digest.

``DockerImageBuilder.build()``:

1. tag = the sha256 of the build context the engine receives (``blocks/docker/context.py``: the
   workload's files after ``.dockerignore``, the Dockerfile, gpuferry's runtime) and the build args;
2. asks the registry (its HTTP API, ``blocks/docker/registry.py``) whether ``repository:tag`` exists: when it
   does, nothing is built and the returned ``ImageRef`` says so (``built=False``);
3. otherwise builds (``rm=True``, ``pull=False``: the base must be local or pullable by the engine),
   pushes, and reads the manifest digest back from the registry — the digest every later step runs,
   which differs from the local image id because layers are compressed on push.

Errors: a failing Dockerfile step raises ``ImageBuildFailed`` naming the step, with the tail of the build
log; refused credentials or a missing permission raise ``ConfigurationError`` (retrying cannot help); an
unreachable registry or engine, an HTTP 5xx/429 and other push failures raise ``TransientError``, which
the build task retries.

The engine is a prefect-docker ``DockerHost`` (``base_url`` or ``DOCKER_HOST``); the registry and its
login are a prefect-docker ``DockerRegistryCredentials``. A registry that speaks plain HTTP (a local
one) is written ``http://host:port`` in ``registry_url`` (or set ``plain_http``); the engine must list
it as insecure too (podman: registries.conf, Docker: ``insecure-registries``).
"""

from __future__ import annotations

import io
import re
import time
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
import requests.exceptions
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost
from pydantic import Field, field_validator

from blocks.base.images import ImageBuilder
from blocks.base.log import run_logger
from blocks.checks import CheckRow, Probe
from blocks.docker.context import BuildContext, build_context
from blocks.docker.registry import RegistryClient, _classify_push_error, registry_base_url
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.records import Garbage, ImageRef
from blocks.values import REPOSITORY, registry_parts

if TYPE_CHECKING:
    from blocks.workload.source import Workload


# Step headers: podman/buildah "STEP 3/7: RUN ...", the Docker engine "Step 3/7 : RUN ...".
_STEP_RE = re.compile(r"^(?:STEP|Step) \d+/\d+ ?: .*")
_PUSH_DIGEST_RE = re.compile(r"digest: (sha256:[0-9a-f]{64})")


LOG_TAIL_LINES = 40


class ImageBuildFailed(GpuferryError):
    """A Dockerfile step failed. Not transient: the Dockerfile or the context must change."""

    def __init__(self, message: str, *, step: str | None, log_tail: str) -> None:
        where = f"at {step}" if step else "before its first step"
        super().__init__(f"image build failed {where}: {message}\n--- last lines of the build log ---\n{log_tail}")
        self.step = step
        self.log_tail = log_tail


class DockerImageBuilder(ImageBuilder):
    """Builds the image with a Docker engine or podman, pushes it, and pins it by registry digest."""

    _block_type_name = "gpuferry Docker Image Builder"
    _description = (
        "Builds the workload image (tagged by a hash of its build context), pushes it to a registry and "
        "returns it pinned by digest; an image whose tag is already in the registry is not rebuilt."
    )

    docker_host: DockerHost = Field(
        default_factory=DockerHost,
        description="The Docker engine (or podman's Docker API socket) that builds and pushes; "
        "without base_url it follows DOCKER_HOST.",
    )
    credentials: DockerRegistryCredentials = Field(
        description="Registry address (host[:port], http:// for a plain-HTTP registry) and its login.",
    )
    repository: str = Field(
        description="Repository inside the registry, without host or tag, e.g. team/gpuferry-workload.",
        examples=["gpuferry/workload"],
    )
    plain_http: bool = Field(
        False, description="The registry speaks plain HTTP (same as writing http:// in credentials.registry_url)."
    )
    nocache: bool = Field(False, description="Build without the engine's layer cache.")
    build_timeout_s: int = Field(
        3600,
        gt=0,
        description="Longest wait for the engine's next build or push output (when docker_host has no timeout).",
    )

    @field_validator("repository")
    @classmethod
    def _check_repository(cls, value: str) -> str:
        if not REPOSITORY.match(value):
            raise ValueError(
                f"repository={value!r} is not a valid repository path: lowercase letters, digits and . _ - "
                "separated by /, without the registry host or a tag (e.g. gpuferry/workload)"
            )
        return value

    # ------------------------------------------------------------------------------------------ helpers

    def registry_host(self) -> str:
        return registry_parts(self.credentials.registry_url)[1]

    def image_name(self) -> str:
        """``host[:port]/repository``: the name the engine tags and pushes."""
        return f"{self.registry_host()}/{self.repository}"

    def _registry_base_url(self) -> str:
        return registry_base_url(self.credentials.registry_url, plain_http=self.plain_http)

    def registry(self) -> RegistryClient:
        return RegistryClient(
            self._registry_base_url(), self.credentials.username, self.credentials.password.get_secret_value()
        )

    def _auth_config(self) -> dict[str, str]:
        return {
            "username": self.credentials.username,
            "password": self.credentials.password.get_secret_value(),
            "serveraddress": self.registry_host(),
        }

    def _client(self) -> docker.DockerClient:
        host = self.docker_host
        if host.timeout is None:
            host = host.model_copy(update={"timeout": self.build_timeout_s})
        try:
            return host.get_client()
        except docker.errors.DockerException as exc:
            raise TransientError(
                f"cannot reach the Docker engine ({host.base_url or 'DOCKER_HOST'}): {exc} — is it (or "
                "`podman system service`) running?"
            ) from exc

    def _validate(self) -> None:
        registry_parts(self.credentials.registry_url)
        for key, value in self.build_args.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ConfigurationError(f"build_args key {key!r} is not a valid ARG name")
            if not isinstance(value, str):
                raise ConfigurationError(f"build_args[{key!r}] must be a string, got {type(value).__name__}")

    # ---------------------------------------------------------------------------------------- the steps

    def find(self, tag: str) -> str | None:
        """The registry digest of ``repository:tag``, or None."""
        registry = self.registry()
        try:
            return registry.manifest_digest(self.repository, tag)
        finally:
            registry.close()

    def context(self, workload: Workload) -> BuildContext:
        """What the engine receives for ``workload`` (its tag is the image's content tag)."""
        self._validate()
        return build_context(workload, self.build_args)

    def _build_image(self, client: docker.DockerClient, name: str, context: BuildContext) -> str:
        lines: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        step: str | None = None
        image_id = ""
        try:
            stream = client.api.build(
                fileobj=io.BytesIO(context.tar),
                custom_context=True,
                dockerfile=context.dockerfile,
                tag=name,
                buildargs=dict(context.build_args),
                rm=True,
                forcerm=True,
                pull=False,
                nocache=self.nocache,
                decode=True,
            )
            for event in stream:
                if "stream" in event:
                    for line in str(event["stream"]).splitlines():
                        if line.strip():
                            lines.append(line)
                            if _STEP_RE.match(line):
                                step = line.strip()
                if "aux" in event and isinstance(event["aux"], dict):
                    image_id = event["aux"].get("ID", image_id)
                if "error" in event:
                    message = str(event.get("errorDetail", {}).get("message") or event["error"]).strip()
                    raise ImageBuildFailed(message, step=step, log_tail="\n".join(lines))
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise TransientError(f"lost the Docker engine while building {name}: {exc}") from exc
        except docker.errors.APIError as exc:
            if exc.status_code is not None and exc.status_code >= 500 and step is None:
                raise TransientError(f"the Docker engine failed to start the build of {name}: {exc}") from exc
            raise ImageBuildFailed(str(exc), step=step, log_tail="\n".join(lines)) from exc
        return image_id

    def _push(self, client: docker.DockerClient, name: str, tag: str) -> str | None:
        pushed_digest = None
        try:
            for event in client.api.push(name, tag=tag, auth_config=self._auth_config(), stream=True, decode=True):
                if "error" in event:
                    message = str(event.get("errorDetail", {}).get("message") or event["error"])
                    raise _classify_push_error(message, f"{name}:{tag}")
                status = str(event.get("status", ""))
                found = _PUSH_DIGEST_RE.search(status)
                if found:
                    pushed_digest = found.group(1)
                if isinstance(event.get("aux"), dict) and "Digest" in event["aux"]:
                    pushed_digest = event["aux"]["Digest"]
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise TransientError(f"lost the Docker engine while pushing {name}:{tag}: {exc}") from exc
        except docker.errors.APIError as exc:
            raise _classify_push_error(str(exc), f"{name}:{tag}") from exc
        return pushed_digest

    def build(self, workload: Workload) -> ImageRef:
        context = self.context(workload)
        log = run_logger("gpuferry.images")
        tag = context.tag
        name = self.image_name()
        registry = self.registry()
        try:
            # Also checks, before any build, that the registry answers and takes the credentials.
            digest = registry.manifest_digest(self.repository, tag)
            if digest is not None:
                log.info("image %s:%s is already in the registry (%s): not rebuilt", name, tag, digest)
                return ImageRef(
                    builder=self.get_block_type_slug(),
                    content_tag=tag,
                    reference=f"{name}@{digest}",
                    workdir=context.workdir,
                    built=False,
                    note=f"content tag {tag} already in {name}: build skipped",
                )
            started = time.monotonic()
            log.info("building %s:%s (%s)", name, tag, context.description)
            client = self._client()
            try:
                image_id = self._build_image(client, f"{name}:{tag}", context)
                built_s = time.monotonic() - started
                log.info("built %s:%s (%s) in %.1fs; pushing", name, tag, image_id or "?", built_s)
                pushed_digest = self._push(client, name, tag)
            finally:
                client.close()
            digest = registry.manifest_digest(self.repository, tag)
            if digest is None:
                raise TransientError(f"pushed {name}:{tag} but the registry does not list it yet")
            if pushed_digest and pushed_digest != digest:
                log.warning(
                    "the engine reported digest %s, the registry holds %s: using the registry's", pushed_digest, digest
                )
            total_s = time.monotonic() - started
            log.info("pushed %s:%s as %s@%s (%.1fs)", name, tag, name, digest, total_s)
            return ImageRef(
                builder=self.get_block_type_slug(),
                content_tag=tag,
                reference=f"{name}@{digest}",
                workdir=context.workdir,
                built=True,
                note=f"built and pushed {name}:{tag} in {total_s:.1f}s",
            )
        finally:
            registry.close()

    # ---- housekeeping (``gpuferry gc``) ----

    def stored_images(self) -> list[Garbage]:
        """Every image of ``repository`` in the registry, one per digest whatever its tags, with its size (its
        layers and configuration, every platform's of an index) and when it was built (its configuration's
        ``created``; an image that does not say counts as built now, so it is never old)."""
        registry = self.registry()
        try:
            digests = {registry.manifest_digest(self.repository, tag) for tag in registry.tags(self.repository)}
            found = []
            for digest in sorted(d for d in digests if d):
                size, built = self._weigh(registry, digest)
                found.append(
                    Garbage(kind="image", where=f"{self.image_name()}@{digest}", size_bytes=size, modified=built)
                )
            return found
        finally:
            registry.close()

    def _weigh(self, registry: RegistryClient, digest: str) -> tuple[int, float]:
        _, manifest = registry.manifest(self.repository, digest)
        parts = [registry.manifest(self.repository, m["digest"])[1] for m in manifest.get("manifests", [])]
        parts = parts or [manifest]
        size = sum(
            int((part.get("config") or {}).get("size", 0))
            + sum(int(layer.get("size", 0)) for layer in part.get("layers", []))
            for part in parts
        )
        config = parts[0].get("config") or {}
        built = (
            _created(registry.blob_json(self.repository, config["digest"]).get("created"))
            if config.get("digest")
            else None
        )
        return size, built if built is not None else time.time()

    def remove_image(self, where: str) -> None:
        """Delete an image ``stored_images`` listed (``<registry>/<repository>@sha256:...``) from the registry: its
        tags go with it; the registry frees its layers when it collects its own garbage."""
        name, _, digest = where.rpartition("@")
        if name != self.image_name() or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ConfigurationError(f"{where} is not an image of {self.image_name()} by digest")
        registry = self.registry()
        try:
            registry.delete_manifest(self.repository, digest)
        finally:
            registry.close()

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The engine, the registry's login and push permission (``blocks/checks.py``)."""
        from blocks.docker.check import check_docker_builder

        check_docker_builder(self, probe)
        return probe.rows


def _created(value: Any) -> float | None:
    """An image configuration's ``created`` (RFC 3339, nanoseconds allowed) as epoch seconds."""
    if not isinstance(value, str):
        return None
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", value.strip())
    if match is None:
        return None
    fraction = (match[2] or ".0")[:7]
    zone = "+00:00" if match[3] == "Z" else match[3]
    return datetime.fromisoformat(f"{match[1]}{fraction}{zone}").timestamp()
