"""Build the workload's image with a Docker engine (or podman's Docker API), push it, pin it by digest.

``DockerImageBuilder.build()``:

1. tag = the sha256 of the build context the engine receives (``blocks.images.build_context``: the
   workload's files after ``.dockerignore``, the Dockerfile, gpuferry's runtime) and the build args;
2. asks the registry (its HTTP API) whether ``repository:tag`` exists: when it does, nothing is built and
   the returned ``ImageRef`` says so (``built=False``);
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

import hashlib
import io
import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
import httpx
import requests.exceptions
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost
from pydantic import Field, field_validator

from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.images import BuildContext, ImageBuilder, build_context
from blocks.specs import ImageRef

if TYPE_CHECKING:
    from blocks.workload import Workload

# Docker's reference grammar for a repository path (no registry host, no tag).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_REGISTRY_RE = re.compile(r"^(?:(?P<scheme>https?)://)?(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?)/?$")
# Step headers: podman/buildah "STEP 3/7: RUN ...", the Docker engine "Step 3/7 : RUN ...".
_STEP_RE = re.compile(r"^(?:STEP|Step) \d+/\d+ ?: .*")
_PUSH_DIGEST_RE = re.compile(r"digest: (sha256:[0-9a-f]{64})")
MANIFEST_TYPES = ", ".join((
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
))  # fmt: skip
LOG_TAIL_LINES = 40
_AUTH_WORDS = ("unauthorized", "authentication required", "denied", "forbidden", "incorrect username or password")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("gpuferry.images")


class ImageBuildFailed(GpuferryError):
    """A Dockerfile step failed. Not transient: the Dockerfile or the context must change."""

    def __init__(self, message: str, *, step: str | None, log_tail: str) -> None:
        where = f"at {step}" if step else "before its first step"
        super().__init__(f"image build failed {where}: {message}\n--- last lines of the build log ---\n{log_tail}")
        self.step = step
        self.log_tail = log_tail


def _registry_parts(registry_url: str) -> tuple[str | None, str]:
    match = _REGISTRY_RE.match(registry_url.strip())
    if not match:
        raise ConfigurationError(
            f"credentials.registry_url={registry_url!r} is not a registry address: "
            "write host[:port], optionally with http:// or https://, e.g. 127.0.0.1:5000 or ghcr.io"
        )
    host = match["host"]
    if host in ("docker.io", "index.docker.io"):
        host = "docker.io"
    return match["scheme"], host


class RegistryClient:
    """The few Docker Registry HTTP API v2 calls the builder needs, with Basic or Bearer-token auth."""

    def __init__(self, base_url: str, username: str, password: str, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._basic = httpx.BasicAuth(username, password)
        self._username = username
        self._http = httpx.Client(timeout=timeout_s)
        self._tokens: dict[str, str] = {}

    def close(self) -> None:
        self._http.close()

    def _token(self, challenge: str, repository: str) -> str:
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", None)
        if not realm:
            raise ConfigurationError(f"registry {self.base_url} sent an auth challenge without a realm: {challenge!r}")
        params.setdefault("scope", f"repository:{repository}:pull")
        key = f"{realm} {params}"
        if key not in self._tokens:
            response = self._send("GET", realm, auth=self._basic, params=params)
            if response.status_code in (401, 403):
                raise self._refused(response)
            self._raise_for_status(response, "token")
            body = response.json()
            self._tokens[key] = body.get("token") or body.get("access_token") or ""
        return self._tokens[key]

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, url, **kwargs)
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise TransientError(
                f"registry {self.base_url} is unreachable ({type(exc).__name__}: {exc}): is it running, and is "
                "credentials.registry_url right (http:// for a plain-HTTP registry)?"
            ) from exc

    def _refused(self, response: httpx.Response) -> ConfigurationError:
        verb = "refused the credentials of" if response.status_code == 401 else "denies access to"
        return ConfigurationError(
            f"registry {self.base_url} {verb} user {self._username!r} (HTTP {response.status_code}): "
            "fix credentials.username / credentials.password or the user's permissions on the repository"
        )

    def _raise_for_status(self, response: httpx.Response, what: str) -> None:
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientError(f"registry {self.base_url} answered HTTP {response.status_code} to {what}")
        if response.status_code >= 400:
            raise GpuferryError(
                f"registry {self.base_url} answered HTTP {response.status_code} to {what}: {response.text[:300]}"
            )

    def manifest_digest(self, repository: str, tag: str) -> str | None:
        """The digest the registry holds for ``repository:tag``, or None when the tag is not there."""
        url = f"{self.base_url}/v2/{repository}/manifests/{tag}"
        headers = {"Accept": MANIFEST_TYPES}
        response = self._send("HEAD", url, headers=headers, auth=self._basic)
        challenge = response.headers.get("www-authenticate", "")
        if response.status_code == 401 and challenge.lower().startswith("bearer"):
            token = self._token(challenge[len("bearer") :].strip(), repository)
            headers["Authorization"] = f"Bearer {token}"
            response = self._send("HEAD", url, headers=headers)
        if response.status_code == 404:
            return None
        if response.status_code in (401, 403):
            raise self._refused(response)
        self._raise_for_status(response, f"HEAD {repository}:{tag}")
        digest = response.headers.get("docker-content-digest")
        if digest:
            return digest
        # Registries need not send the header: the digest is the sha256 of the manifest's bytes.
        body = self._send("GET", url, headers=headers, auth=None if "Authorization" in headers else self._basic)
        self._raise_for_status(body, f"GET {repository}:{tag}")
        return "sha256:" + hashlib.sha256(body.content).hexdigest()


    def _authorized(self, method: str, url: str, repository: str, **kwargs: Any) -> httpx.Response:
        """``method url`` with Basic auth, again with a Bearer token when the registry asks for one."""
        response = self._send(method, url, auth=self._basic, **kwargs)
        challenge = response.headers.get("www-authenticate", "")
        if response.status_code == 401 and challenge.lower().startswith("bearer"):
            token = self._token(challenge[len("bearer") :].strip(), repository)
            headers = {**kwargs.pop("headers", {}), "Authorization": f"Bearer {token}"}
            response = self._send(method, url, headers=headers, **kwargs)
        return response

    def check_login(self, repository: str = "library/gpuferry-check") -> str:
        """The registry answers its API and takes the credentials (``GET /v2/``)."""
        response = self._authorized("GET", f"{self.base_url}/v2/", repository)
        if response.status_code in (401, 403):
            raise self._refused(response)
        self._raise_for_status(response, "GET /v2/")
        return f"{self.base_url} takes the login of {self._username!r}"

    def check_push(self, repository: str) -> str:
        """The credentials may push to ``repository``: a blob upload is started and cancelled, nothing stored."""
        response = self._authorized("POST", f"{self.base_url}/v2/{repository}/blobs/uploads/", repository)
        if response.status_code in (401, 403):
            raise ConfigurationError(
                f"registry {self.base_url} does not let {self._username!r} push to {repository} "
                f"(HTTP {response.status_code}): grant the user push on the repository, or fix repository"
            )
        self._raise_for_status(response, f"POST /v2/{repository}/blobs/uploads/")
        location = response.headers.get("location", "")
        if location:
            url = location if "://" in location else f"{self.base_url}{location}"
            self._authorized("DELETE", url, repository)
        return f"{self._username!r} may push to {repository} (an upload was started and cancelled)"


def _classify_push_error(message: str, image: str) -> GpuferryError:
    lowered = message.lower()
    if any(word in lowered for word in _AUTH_WORDS):
        return ConfigurationError(
            f"push of {image} refused: {message.strip()} — fix credentials.username / credentials.password "
            "or the user's push permission on the repository"
        )
    if "server gave http response to https client" in lowered:
        return ConfigurationError(
            f"push of {image} failed: {message.strip()} — the registry speaks plain HTTP: mark it insecure in the "
            "engine (podman: registries.conf `insecure = true`; Docker: daemon.json `insecure-registries`)"
        )
    return TransientError(f"push of {image} failed: {message.strip()}")


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
        3600, gt=0, description="Longest wait for the engine's next build or push output (when docker_host has no timeout)."
    )

    @field_validator("repository")
    @classmethod
    def _check_repository(cls, value: str) -> str:
        if not _REPOSITORY_RE.match(value):
            raise ValueError(
                f"repository={value!r} is not a valid repository path: lowercase letters, digits and . _ - "
                "separated by /, without the registry host or a tag (e.g. gpuferry/workload)"
            )
        return value

    # ------------------------------------------------------------------------------------------ helpers

    def registry_host(self) -> str:
        return _registry_parts(self.credentials.registry_url)[1]

    def image_name(self) -> str:
        """``host[:port]/repository``: the name the engine tags and pushes."""
        return f"{self.registry_host()}/{self.repository}"

    def _registry_base_url(self) -> str:
        scheme, host = _registry_parts(self.credentials.registry_url)
        if host == "docker.io":
            host = "registry-1.docker.io"
        return f"{scheme or ('http' if self.plain_http else 'https')}://{host}"

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
        _registry_parts(self.credentials.registry_url)
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
        log = _logger()
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
                log.warning("the engine reported digest %s, the registry holds %s: using the registry's",
                            pushed_digest, digest)  # fmt: skip
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

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The engine, the registry's login and push permission (``blocks/check_services.py``)."""
        from blocks.check_services import check_docker_builder

        check_docker_builder(self, probe)
        return probe.rows
