"""One Docker Engine (or podman) as the Docker backends use it: connection, containers, GPU claims, logs.

``Engine`` wraps a docker-py client made by prefect-docker's ``DockerHost`` (a local socket, ``tcp://``
with TLS, ``ssh://``). It tells a Docker Engine from podman (``/version``) and creates containers through
the API that carries GPUs there: the Docker Engine API on Docker, podman's own API on podman (its
Docker-compatible API ignores device requests). Everything else — start, stop, inspect, logs, labels —
goes through the Docker API, which both speak.

The engine itself is the record of which GPUs are in use: every container gpuferry starts carries its
GPUs in a label. ``create_with_gpus`` chooses GPUs from those claims, creates the container (not
started), then reads the claims again: when a container created earlier claims one of the same GPUs (two
submits at once), the later one is removed and chooses again. A lock file serialises the processes of
this machine around it.

Errors: an engine that cannot be reached, or answers 502-504, is a ``TransientError``; a refused
container (an unknown image or CDI device, a bad mount) is a ``ConfigurationError`` naming the fix.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import docker
import docker.constants
import docker.errors
import paramiko
import requests.exceptions
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost

from blocks.docker.gpu_alloc import Claim, GpuRequest, HostGpu, choose, parse_claim_label
from blocks.docker.spec import (
    EXIT_RECORD,
    LABEL_GPU_SHARING,
    LABEL_GPUS,
    LABEL_KIND,
    LABEL_WORKDIR,
    ContainerSpec,
    docker_body,
    libpod_body,
)
from blocks.docker.transport import Connection, DockerTls, tls_failure
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.home import gpuferry_home
from blocks.ssh.credentials import SshCredentials
from blocks.values import registry_parts
from runtime import contract

LIBPOD_API = "/v4.0.0/libpod"  # podman 4 and later serve their own API under any version from 4.0.0
HOLDING_STATES = frozenset({"created", "running", "paused", "restarting", "stopping", "configured"})
_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)? ?")
LOG_OFFSET_SPAN = 1_000_000  # a log offset is second * this + the lines of that second already read


class NameInUse(GpuferryError):
    """A container of that name exists already."""


def _explain(exc: docker.errors.APIError) -> str:
    return str(getattr(exc, "explanation", None) or exc)


class Engine:
    """A Docker Engine or podman reached through ``docker_host`` (with ``tls`` or ``ssh`` settings when given,
    ``blocks/docker/transport.py``); ``api``: auto, docker or libpod."""

    def __init__(
        self,
        docker_host: DockerHost,
        *,
        api: str = "auto",
        timeout: float = 120.0,
        tls: DockerTls | None = None,
        ssh: SshCredentials | None = None,
    ) -> None:
        self.docker_host = docker_host
        self.api_choice = api
        self.timeout = timeout
        self.tls, self.ssh = tls, ssh
        self._connection: Connection | None = None
        self._client: docker.DockerClient | None = None
        self._api: str | None = None
        self._lock = threading.RLock()

    # ---- connection ------------------------------------------------------------------------

    @property
    def where(self) -> str:
        return self.docker_host.base_url or "DOCKER_HOST"

    @property
    def client(self) -> docker.DockerClient:
        """The SDK's client. Its API version comes from ``/_ping`` as the docker CLI negotiates it (the SDK's own
        ``version="auto"`` asks ``/version``, which podman answers in ~0.5 s), and so does what the engine is."""
        with self._lock:
            if self._client is None:
                host = self.docker_host
                negotiate = host.version == "auto"
                update: dict[str, Any] = {"version": docker.constants.MINIMUM_DOCKER_API_VERSION} if negotiate else {}
                if host.timeout is None:
                    update["timeout"] = int(self.timeout)
                try:
                    try:
                        self._connection = Connection(host.model_copy(update=update), self.tls, self.ssh)
                        client = self._connection.client
                        with self.calling("answer /_ping"):
                            ping = client.api._get(client.api._url("/_ping", versioned_api=False))
                            client.api._raise_for_status(ping)
                    except BaseException:
                        self.close()
                        raise
                except (docker.errors.DockerException, paramiko.SSHException, OSError, EOFError) as exc:
                    raise TransientError(
                        f"cannot reach the Docker engine at {self.where}: {exc} — is it (or `podman system "
                        "service`) running, and is docker_host.base_url right?"
                    ) from exc
                if negotiate and ping.headers.get("Api-Version"):
                    client.api._version = ping.headers["Api-Version"]  # what version="auto" would have set
                if self._api is None:
                    self._api = "libpod" if ping.headers.get("Libpod-Api-Version") else "docker"
                self._client = client
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
            self._connection = self._client = None

    @contextmanager
    def calling(self, what: str) -> Iterator[None]:
        """Map the SDK's errors: unreachable or 502-504 → TransientError, any other refusal → ConfigurationError."""
        try:
            yield
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            refused = tls_failure(self.where, what, exc)
            if refused:
                raise ConfigurationError(refused) from exc
            raise TransientError(f"the Docker engine at {self.where} did not answer ({what}): {exc}") from exc
        except docker.errors.NotFound:
            raise
        except docker.errors.APIError as exc:
            text = _explain(exc)
            if exc.status_code == 409 or "already in use" in text:
                raise NameInUse(text) from exc
            if exc.status_code in (502, 503, 504):
                raise TransientError(
                    f"the Docker engine at {self.where} answered {exc.status_code} ({what}): {text}"
                ) from exc
            raise ConfigurationError(
                f"the Docker engine at {self.where} refused to {what}: {text}{_hint(text)}"
            ) from exc
        except docker.errors.DockerException as exc:
            raise TransientError(f"the Docker engine at {self.where} failed to {what}: {exc}") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if self.ssh is None:
                raise
            # The block's SSH connection made again on the way (last: the SDK's errors are OSErrors too; a refused
            # login or host key is a ConfigurationError).
            raise TransientError(
                f"the SSH connection to the Docker engine at {self.where} failed ({what}): {exc}"
            ) from exc

    @property
    def api(self) -> str:
        """``libpod`` on podman (its ``/_ping`` says Libpod-Api-Version), else ``docker``; ``api`` may fix it."""
        if self.api_choice != "auto":
            return self.api_choice
        with self._lock:
            self.client  # noqa: B018 - its /_ping says what the engine is
            assert self._api is not None
            return self._api

    @property
    def host_name(self) -> str:
        """The engine's host as clients reach it: 127.0.0.1 for a local socket."""
        parsed = urlparse(self.docker_host.base_url or "")
        if parsed.scheme in ("tcp", "ssh", "http", "https") and parsed.hostname:
            return parsed.hostname
        return "127.0.0.1"

    # ---- images ------------------------------------------------------------------------------

    def ensure_image(self, reference: str, credentials: DockerRegistryCredentials | None) -> None:
        """Pull ``reference`` (pinned by digest) unless the engine has it, with the registry login if given."""
        try:
            with self.calling(f"look up the image {reference}"):
                self.client.images.get(reference)
            return
        except docker.errors.NotFound:
            pass
        auth = None
        if credentials is not None:
            auth = {
                "username": credentials.username,
                "password": credentials.password.get_secret_value(),
                "serveraddress": registry_parts(credentials.registry_url)[1],
            }
        try:
            with self.calling(f"pull {reference}"):
                self.client.images.pull(reference, auth_config=auth)
        except docker.errors.NotFound as exc:
            raise ConfigurationError(f"the registry has no image {reference}: {_explain(exc)}") from exc
        except ConfigurationError as exc:
            words = ("unauthorized", "authentication required", "denied")
            if any(w in str(exc).lower() for w in words):
                raise ConfigurationError(
                    f"pulling {reference} was refused: fix registry_credentials (username/password of the registry)"
                ) from exc
            raise

    # ---- containers ------------------------------------------------------------------------

    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the container; ``NameInUse`` when one of that name exists."""
        with self.calling(f"create the container {spec.name}"):
            if self.api == "libpod":
                api = self.client.api
                response = api._post_json(f"{api.base_url}{LIBPOD_API}/containers/create", data=libpod_body(spec))
                return str(api._result(response, True)["Id"])
            return str(self.client.api.create_container_from_config(docker_body(spec), name=spec.name)["Id"])

    def start(self, container: str) -> None:
        with self.calling(f"start the container {container}"):
            self.client.api.start(container)

    def inspect(self, container: str) -> dict[str, Any] | None:
        try:
            with self.calling(f"inspect the container {container}"):
                return self.client.api.inspect_container(container)
        except docker.errors.NotFound:
            return None

    def stop(self, container: str, timeout: int) -> None:
        try:
            with self.calling(f"stop the container {container}"):
                self.client.api.stop(container, timeout=timeout)
        except docker.errors.NotFound:
            pass

    def remove(self, container: str) -> None:
        try:
            with self.calling(f"remove the container {container}"):
                self.client.api.remove_container(container, force=True)
        except docker.errors.NotFound:
            pass

    def rename(self, container: str, name: str) -> None:
        with self.calling(f"rename the container {container} to {name}"):
            self.client.api.rename(container, name)

    def exec(self, container: str, argv: Sequence[str]) -> tuple[int, str]:
        """Run ``argv`` in the running container (``docker exec``): (exit code, its output)."""
        with self.calling(f"run {argv[0]} in the container {container}"):
            api = self.client.api
            created = api.exec_create(container, list(argv), stdout=True, stderr=True)
            output = api.exec_start(created["Id"])
            code = api.exec_inspect(created["Id"]).get("ExitCode")
        text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
        return (-1 if code is None else int(code)), text

    def ensure_network(self, name: str, labels: Mapping[str, str]) -> None:
        """A user-defined bridge network ``name`` (its DNS resolves the containers on it), made when missing."""
        with self.calling(f"look up the network {name}"):
            if any(n.get("Name") == name for n in self.client.api.networks(names=[name])):  # the filter matches parts
                return
        try:
            with self.calling(f"create the network {name}"):
                self.client.api.create_network(name, driver="bridge", labels=dict(labels))
        except NameInUse:
            pass  # made meanwhile by another deploy

    def containers(self, labels: Mapping[str, str | None]) -> list[dict[str, Any]]:
        """Every container (any state) with these labels (a value of None: the label, any value)."""
        wanted = [k if v is None else f"{k}={v}" for k, v in labels.items()]
        with self.calling("list containers"):
            return list(self.client.api.containers(all=True, filters={"label": wanted}))

    # ---- GPUs ------------------------------------------------------------------------------

    def gpu_claims(self) -> list[tuple[Claim, dict[str, Any]]]:
        """(claim, the container as listed) of every container that holds GPUs (see ``holds_gpus``)."""
        out = []
        for summary in self.containers({LABEL_GPUS: None}):
            labels = summary.get("Labels") or {}
            gpus = parse_claim_label(labels.get(LABEL_GPUS))
            if not gpus:
                continue
            state = str(summary.get("State", "")).lower()
            if state not in HOLDING_STATES:
                info = self.inspect(summary["Id"])
                if info is None or not holds_gpus(info):
                    continue
            claim = Claim(owner=_owner(summary), gpus=gpus, shared=labels.get(LABEL_GPU_SHARING) == "true")
            out.append((claim, summary))
        return out

    @contextmanager
    def machine_lock(self) -> Iterator[None]:
        """Serialises this machine's processes that choose GPUs on this engine."""
        key = hashlib.sha256(f"{self.where}".encode()).hexdigest()[:16]
        path = gpuferry_home() / "locks" / f"docker-gpus-{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def create_with_gpus(
        self,
        inventory: Sequence[HostGpu],
        request: GpuRequest,
        build: Callable[[list[HostGpu]], ContainerSpec],
        *,
        yielding: Callable[[dict[str, Any]], bool] = lambda s: False,
        host: str = "the host",
        attempts: int = 5,
    ) -> tuple[str, list[HostGpu]]:
        """Choose GPUs, create the container ``build(gpus)`` describes, and make sure no container created
        before it claims the same GPUs (else remove it and choose again). (container id, its GPUs).
        ``yielding(listed)``: containers whose GPUs the new one may take over (``gpu_alloc.choose``)."""
        with self.machine_lock():
            for _ in range(attempts):
                claims = self.gpu_claims()
                hard = [c for c, s in claims if not yielding(s)]
                soft = [c for c, s in claims if yielding(s)]
                gpus = choose(inventory, request, hard, yielding=soft, host=host)
                container = self.create(build(gpus))
                if not gpus or not self._lost_race(container, gpus, request.share, yielding):
                    return container, gpus
                self.remove(container)
            raise TransientError(f"{host}: other containers kept taking the chosen GPUs; try again")

    def _lost_race(
        self, container: str, gpus: list[HostGpu], share: bool, yielding: Callable[[dict[str, Any]], bool]
    ) -> bool:
        mine = self.inspect(container)
        if mine is None:
            return True
        keys = {g.key for g in gpus}
        for claim, summary in self.gpu_claims():
            other = summary["Id"]
            if other == container or yielding(summary) or not keys & set(claim.gpus) or (share and claim.shared):
                continue
            theirs = self.inspect(other)
            if theirs is not None and (_created(theirs), theirs["Id"]) < (_created(mine), mine["Id"]):
                return True
        return False

    # ---- logs ------------------------------------------------------------------------------

    def raw_logs(self, container: str, since: int | None = None) -> bytes | None:
        """The container's output with the engine's timestamps (from second ``since``), or None when it is gone."""
        try:
            with self.calling(f"read the log of {container}"):
                kwargs: dict[str, Any] = {"since": since} if since else {}
                return self.client.api.logs(container, stdout=True, stderr=True, timestamps=True, **kwargs)
        except docker.errors.NotFound:
            return None

    def tail(self, container: str, lines: int) -> str | None:
        try:
            with self.calling(f"read the log of {container}"):
                return self.client.api.logs(container, stdout=True, stderr=True, tail=lines).decode("utf-8", "replace")
        except docker.errors.NotFound:
            return None


def holds_gpus(info: dict[str, Any]) -> bool:
    """Whether a container that is not running still holds its GPUs: a training job that stopped to be
    requeued (exit 75, or the preempted marker) and that its backend has not ended (no exit record)."""
    labels = (info.get("Config") or {}).get("Labels") or {}
    if labels.get(LABEL_KIND) != "job" or not labels.get(LABEL_WORKDIR):
        return False
    workdir = Path(labels[LABEL_WORKDIR])
    if (workdir / EXIT_RECORD).exists():
        return False
    code = (info.get("State") or {}).get("ExitCode")
    return code == contract.EXIT_PREEMPTED or (workdir / "checkpoints" / contract.PREEMPTED_MARKER).exists()


def read_from(raw: bytes, offset: int, *, final: bool) -> tuple[str, int]:
    """The lines of timestamped output ``raw`` past ``offset`` (timestamps stripped), and the next offset.

    An offset is second * LOG_OFFSET_SPAN + the number of lines of that second already read: the engine
    may stamp lines to the second only (podman), so a second is re-read and its lines already seen skipped.
    Only complete lines are read unless ``final`` (the container has ended)."""
    second, seen = divmod(offset, LOG_OFFSET_SPAN)
    text = raw.decode("utf-8", "replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines and not final:
        lines.pop()  # a line still being written
    out = []
    for line in lines:
        match = _TS.match(line)
        stamp = _seconds(match) if match else second
        body = line[match.end() :] if match else line
        if stamp < second:
            continue
        if stamp == second:
            if seen > 0:
                seen -= 1
                continue
            offset += 1
        else:
            second, offset = stamp, stamp * LOG_OFFSET_SPAN + 1
        seen = 0
        out.append(body + "\n")
    return "".join(out), offset


def offset_second(offset: int) -> int:
    return offset // LOG_OFFSET_SPAN


def strip_timestamps(raw: bytes) -> str:
    return "".join(
        line[m.end() :] if (m := _TS.match(line)) else line
        for line in raw.decode("utf-8", "replace").splitlines(keepends=True)
    )


def _seconds(match: re.Match[str]) -> int:
    stamp = datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")
    zone = match.group(2)
    tz = UTC if zone in (None, "Z") else datetime.strptime(zone, "%z").tzinfo
    return int(stamp.replace(tzinfo=tz).timestamp())


def _created(info: dict[str, Any]) -> str:
    """inspect's Created (RFC 3339 with nanoseconds), padded so that strings order as times."""
    created = str(info.get("Created", ""))
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", created)
    if not match:
        return created
    return f"{match.group(1)}{(match.group(2) or '.').ljust(10, '0')}"


def _owner(summary: dict[str, Any]) -> str:
    names = summary.get("Names") or [summary.get("Id", "?")[:12]]
    return f"container {str(names[0]).lstrip('/')}"


def _hint(text: str) -> str:
    lowered = text.lower()
    if "unresolvable cdi devices" in lowered:
        return (
            " — the host's CDI spec has no such device: generate it (nvidia-ctk cdi generate "
            "--output=/etc/cdi/nvidia.yaml), or check the block's cdi_kind"
        )
    if "could not select device driver" in lowered:
        return (
            " — the engine has no GPU device driver: install the NVIDIA Container Toolkit and restart docker "
            "(SshHosts.bootstrap does), or set gpu_mode='cdi' on a Docker with CDI enabled"
        )
    if "no such image" in lowered or "image not known" in lowered:
        return " — the image is not on the engine: it is pulled first when registry_credentials can pull it"
    return ""


def save(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``path`` atomically with ``mode`` (set before a byte is written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.touch(mode=mode)
    tmp.chmod(mode)
    tmp.write_bytes(data)
    tmp.replace(path)
