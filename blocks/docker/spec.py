"""The container of a training job or an inference server, as the engine's API takes it (pure: no I/O).

``training_container(...)``, ``server_container(...)`` and ``front_container(...)`` (a service's fixed address,
``runtime/front.py``) build a ``ContainerSpec`` — image, argv, variables, labels, bind mounts, GPUs, network and
aliases on it, ports, restart policy, health check — and ``docker_body`` /
``libpod_body`` render it as the body of ``POST /containers/create`` of the Docker Engine API, or of
podman's own ``POST /libpod/containers/create``. No value ever passes through a shell: the argv is a list.

GPUs (``gpu_mode``):

* ``nvidia``: a Docker Engine with the NVIDIA Container Toolkit — a device request
  ``{"Driver": "nvidia", "DeviceIDs": [...], "Capabilities": [["gpu"]]}`` (what ``--gpus '"device=0,1"'``
  sends), the GPUs by index or by UUID;
* ``cdi``: CDI device names (``nvidia.com/gpu=0``, ``nvidia.com/gpu=GPU-...``, as ``nvidia-ctk cdi
  generate`` names them): a device request of the ``cdi`` driver on Docker (25 and later, CDI enabled),
  ``devices`` on podman, whose Docker-compatible API ignores device requests.

Secrets never go into the container's configuration (which ``docker inspect`` shows): their values are
in a 0600 file (``blocks/base/secrets.py``) on the host, and the container's argv becomes
``sh -c 'set -a; . "$1"; set +a; shift; exec "$@"' gpuferry-env FILE ARGV...`` — the file's path and the
argv are arguments of the shell, never parsed by it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blocks.base.secrets import check_env_names, with_env_file
from blocks.base.serving import SERVER_COMMAND
from blocks.errors import ConfigurationError, explain_exit_code
from runtime import contract, front

LABEL_PREFIX = "io.gpuferry."
LABEL_KIND = LABEL_PREFIX + "kind"  # "job" or "server"
LABEL_JOB_KEY = LABEL_PREFIX + "job-key"
LABEL_WORKDIR = LABEL_PREFIX + "workdir"
LABEL_SERVICE = LABEL_PREFIX + "service"
LABEL_MODEL_NAME = LABEL_PREFIX + "model-name"
LABEL_MODEL_VERSION = LABEL_PREFIX + "model-version"
LABEL_MODEL_URI = LABEL_PREFIX + "model-uri"
LABEL_PORT = LABEL_PREFIX + "port"
LABEL_READINESS = LABEL_PREFIX + "readiness-path"
LABEL_GPUS = LABEL_PREFIX + "gpus"  # the GPUs it holds: UUIDs (else indices), comma-separated
LABEL_GPU_SHARING = LABEL_PREFIX + "gpu-sharing"  # "true": it lets others share its GPUs
LABEL_FRONT_TARGET = LABEL_PREFIX + "front-target"  # a server's host:port on its network, as its front reaches it

GPU_MODES = ("nvidia", "cdi")
RESTART_POLICIES = ("no", "on-failure", "always", "unless-stopped")


EXIT_RECORD = "exit.json"  # in a job's directory once its backend has ended it: how, and when


FRONT_COMMAND = ("python", "-m", "runtime.front")
FRONT_PORT_IN_CONTAINER = front.DEFAULT_PORT
DEFAULT_NETWORKS = ("bridge", "podman", "default", "host", "none")  # no name resolution between containers


_CDI_KIND = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NAME_PART = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into the container."""

    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class HealthCheck:
    """The engine's own health check: ``command`` run inside the container."""

    command: tuple[str, ...]
    interval_s: float = 10.0
    timeout_s: float = 3.0
    retries: int = 3
    start_period_s: float = 0.0


@dataclass(frozen=True)
class ContainerSpec:
    """One container, engine-neutral. ``gpus``: device ids for ``gpu_mode`` (indices/UUIDs, or CDI names)."""

    name: str
    image: str
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    mounts: tuple[Mount, ...] = ()
    gpus: tuple[str, ...] = ()
    gpu_mode: str = "nvidia"  # one of GPU_MODES (the blocks check it)
    network: str | None = None  # "host", a network's name; None: the engine's default (bridge)
    aliases: tuple[str, ...] = ()  # more names the container answers to on ``network`` (its DNS)
    ports: tuple[int, ...] = ()  # container ports, published on bind_address at ports the engine picks
    host_ports: Mapping[int, int] = field(default_factory=dict)  # container port -> the host port it must have
    bind_address: str = "127.0.0.1"
    restart_policy: str = "no"  # one of RESTART_POLICIES (checked where a spec is made)
    restart_retries: int = 0
    healthcheck: HealthCheck | None = None
    stop_timeout_s: int = 30
    shm_size_mb: int | None = None
    memory_mb: int | None = None


def container_name(*parts: str) -> str:
    """A container name from parts (anything outside the engine's name characters becomes '-')."""
    name = "-".join(_NAME_PART.sub("-", p).strip("-.") for p in parts if p)
    if not name or not name[0].isalnum():
        name = "gpuferry-" + name
    return name[:200]


def check_cdi_kind(kind: str) -> str:
    if not _CDI_KIND.match(kind):
        raise ConfigurationError(f"cdi_kind={kind!r} is not a CDI kind: write vendor/class, e.g. nvidia.com/gpu")
    return kind


def gpu_device_ids(
    keys: Sequence[tuple[int, str | None]], *, by_uuid: bool, gpu_mode: str, cdi_kind: str
) -> tuple[str, ...]:
    """The engine's names of the chosen GPUs (index, UUID): by UUID when the request named UUIDs, else by index."""
    if gpu_mode not in GPU_MODES:
        raise ConfigurationError(f"gpu_mode={gpu_mode!r}: use one of {', '.join(GPU_MODES)}")
    ids = []
    for index, uuid in keys:
        if by_uuid and not uuid:
            raise ConfigurationError(f"GPU {index} was asked for by UUID but the host's inventory has no UUID for it")
        ids.append(uuid if by_uuid and uuid else str(index))
    if gpu_mode == "cdi":
        check_cdi_kind(cdi_kind)
        return tuple(f"{cdi_kind}={i}" for i in ids)
    return tuple(ids)


def gpu_env(count: int) -> dict[str, str]:
    """Variables a container with ``count`` GPUs gets: the GPUs it sees are numbered 0..count-1; none: no GPU at
    all (``void`` keeps the NVIDIA runtime from exposing every GPU to an image that asks for all)."""
    if count == 0:
        return {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(count))}


def training_container(
    *,
    name: str,
    image: str,
    command: Sequence[str],
    env: Mapping[str, str],
    labels: Mapping[str, str],
    workdir: str,
    image_workdir: str | None,
    gpus: tuple[str, ...],
    gpu_count: int,
    gpu_mode: str,
    mounts: Sequence[str] = (),
    user: str | None = None,
    network: str | None = "host",
    shm_size_mb: int | None = None,
    memory_mb: int | None = None,
    stop_timeout_s: int = 30,
    secret_file: str | None = None,
) -> ContainerSpec:
    """The training job's container: the job's directory (and ``mounts``) at the same path inside, its argv run
    from the image's code (``image_workdir``), no restart policy (gpuferry requeues a preempted job itself)."""
    _check_paths([workdir, *mounts], "mounts")
    binds = [Mount(workdir, workdir)] + [Mount(m, m) for m in dict.fromkeys(mounts) if m != workdir]
    argv = tuple(command) if secret_file is None else with_env_file(command, secret_file)
    variables = {**env, **gpu_env(gpu_count), "PYTHONUNBUFFERED": "1"}
    check_env_names(list(variables), "env")
    return ContainerSpec(
        name=name,
        image=image,
        command=argv,
        env=variables,
        labels=dict(labels),
        workdir=image_workdir,
        user=user,
        mounts=tuple(binds),
        gpus=gpus,
        gpu_mode=gpu_mode,
        network=network,
        shm_size_mb=shm_size_mb,
        memory_mb=memory_mb,
        stop_timeout_s=stop_timeout_s,
    )


def server_container(
    *,
    name: str,
    image: str,
    command: Sequence[str] | None,
    port: int,
    env: Mapping[str, str],
    labels: Mapping[str, str],
    workdir: str | None,
    gpus: tuple[str, ...],
    gpu_count: int,
    gpu_mode: str,
    model_dir: str | None = None,
    mounts: Mapping[str, str] | None = None,
    network: str | None = None,
    aliases: Sequence[str] = (),
    bind_address: str = "127.0.0.1",
    restart_policy: str = "unless-stopped",
    restart_retries: int = 0,
    healthcheck: HealthCheck | None = None,
    memory_mb: int | None = None,
    stop_timeout_s: int = 30,
    secret_file: str | None = None,
) -> ContainerSpec:
    """The inference server's container: ``command`` (None: gpuferry's MLflow model server) listening on
    ``port`` on every address inside, published on ``bind_address``; a ``file://`` model's directory
    (``model_dir``), ``mounts`` (host path -> container path) and the 0600 ``secret_file`` read-only."""
    if restart_policy not in RESTART_POLICIES:
        raise ConfigurationError(f"restart_policy={restart_policy!r}: use one of {', '.join(RESTART_POLICIES)}")
    binds = []
    if model_dir:
        _check_paths([model_dir], "the model's directory")
        binds.append(Mount(model_dir, model_dir, read_only=True))
    for host, target in sorted((mounts or {}).items()):
        _check_paths([host, target], "mounts")
        binds.append(Mount(host, target, read_only=True))
    if secret_file:
        _check_paths([secret_file], "the secret file")
        binds.append(Mount(secret_file, secret_file, read_only=True))
    argv = tuple(command) if command else SERVER_COMMAND
    if secret_file is not None:
        argv = with_env_file(argv, secret_file)
    variables = {
        contract.MODEL_DEVICE: "cuda" if gpu_count else "cpu",  # the block's env may say otherwise
        **env,
        **gpu_env(gpu_count),
        contract.HOST: "0.0.0.0",
        contract.PORT: str(port),
        "PYTHONUNBUFFERED": "1",
    }
    check_env_names(list(variables), "env")
    return ContainerSpec(
        name=name,
        image=image,
        command=argv,
        env=variables,
        labels=dict(labels),
        workdir=workdir,
        mounts=tuple(binds),
        gpus=gpus,
        gpu_mode=gpu_mode,
        network=network,
        aliases=tuple(aliases),
        ports=(port,),
        bind_address=bind_address,
        restart_policy=restart_policy,
        restart_retries=restart_retries,
        healthcheck=healthcheck,
        memory_mb=memory_mb,
        stop_timeout_s=stop_timeout_s,
    )


def front_container(
    *,
    name: str,
    image: str,
    target: str,
    labels: Mapping[str, str],
    network: str,
    bind_address: str,
    host_port: int | None,
    restart_policy: str = "unless-stopped",
) -> ContainerSpec:
    """The service's front (``runtime/front.py``): listens on ``FRONT_PORT_IN_CONTAINER``, published on
    ``bind_address`` at ``host_port`` (None: a port the engine picks), and forwards to ``target`` (host:port on
    ``network``) until the deploy sets another. No GPU."""
    if restart_policy not in RESTART_POLICIES:
        raise ConfigurationError(f"restart_policy={restart_policy!r}: use one of {', '.join(RESTART_POLICIES)}")
    variables = {
        **gpu_env(0),
        "PYTHONUNBUFFERED": "1",
        front.PORT_ENV: str(FRONT_PORT_IN_CONTAINER),
        front.TARGET_ENV: target,
    }
    return ContainerSpec(
        name=name,
        image=image,
        command=FRONT_COMMAND,
        env=variables,
        labels=dict(labels),
        network=network,
        ports=(FRONT_PORT_IN_CONTAINER,),
        bind_address=bind_address,
        host_ports={FRONT_PORT_IN_CONTAINER: host_port} if host_port else {},
        restart_policy=restart_policy,
        stop_timeout_s=10,
    )


def http_probe(port: int, path: str) -> tuple[str, ...]:
    """A health-check command for an image with Python (gpuferry's server's): GET ``path``, fail unless 2xx."""
    url = f"http://127.0.0.1:{port}{path}"
    return ("python", "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=3)")


def _check_paths(paths: Sequence[str], what: str) -> None:
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/") or "\x00" in path or ":" in path:
            raise ConfigurationError(f"{what}: {path!r} must be an absolute path without ':'")


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def docker_body(spec: ContainerSpec) -> dict[str, Any]:
    """``POST /containers/create`` of the Docker Engine API (the name goes in the query: ``?name=``)."""
    host: dict[str, Any] = {
        "Mounts": [
            {"Type": "bind", "Source": m.source, "Target": m.target, "ReadOnly": m.read_only} for m in spec.mounts
        ],
        "RestartPolicy": {
            "Name": "" if spec.restart_policy == "no" else spec.restart_policy,
            "MaximumRetryCount": spec.restart_retries if spec.restart_policy == "on-failure" else 0,
        },
    }
    if spec.network:
        host["NetworkMode"] = spec.network
    if spec.gpus:
        if spec.gpu_mode == "nvidia":
            host["DeviceRequests"] = [{"Driver": "nvidia", "DeviceIDs": list(spec.gpus), "Capabilities": [["gpu"]]}]
        else:
            host["DeviceRequests"] = [{"Driver": "cdi", "DeviceIDs": list(spec.gpus)}]
    if spec.ports:
        host["PortBindings"] = {
            f"{p}/tcp": [{"HostIp": spec.bind_address, "HostPort": str(spec.host_ports.get(p, ""))}] for p in spec.ports
        }
    if spec.shm_size_mb:
        host["ShmSize"] = spec.shm_size_mb << 20
    if spec.memory_mb:
        host["Memory"] = spec.memory_mb << 20
    body: dict[str, Any] = {
        "Image": spec.image,
        "Cmd": list(spec.command),
        "Env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
        "Labels": dict(sorted(spec.labels.items())),
        "StopSignal": "SIGTERM",
        "StopTimeout": spec.stop_timeout_s,
        "HostConfig": host,
    }
    if spec.workdir:
        body["WorkingDir"] = spec.workdir
    if spec.user:
        body["User"] = spec.user
    if spec.ports:
        body["ExposedPorts"] = {f"{p}/tcp": {} for p in spec.ports}
    if spec.aliases and spec.network:
        body["NetworkingConfig"] = {"EndpointsConfig": {spec.network: {"Aliases": list(spec.aliases)}}}
    if spec.healthcheck:
        h = spec.healthcheck
        body["Healthcheck"] = {
            "Test": ["CMD", *h.command],
            "Interval": _ns(h.interval_s),
            "Timeout": _ns(h.timeout_s),
            "Retries": h.retries,
            "StartPeriod": _ns(h.start_period_s),
        }
    return body


def libpod_body(spec: ContainerSpec) -> dict[str, Any]:
    """``POST /libpod/containers/create`` of podman's own API (podman 4 and later)."""
    if spec.gpus and spec.gpu_mode != "cdi":
        raise ConfigurationError(
            "podman takes GPUs as CDI devices only: set gpu_mode='cdi' (and generate the host's CDI spec: "
            "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml)"
        )
    body: dict[str, Any] = {
        "name": spec.name,
        "image": spec.image,
        "command": list(spec.command),
        "env": dict(sorted(spec.env.items())),
        "labels": dict(sorted(spec.labels.items())),
        "mounts": [
            {
                "type": "bind",
                "source": m.source,
                "destination": m.target,
                "options": ["rbind", "ro" if m.read_only else "rw"],
            }
            for m in spec.mounts
        ],
        "stop_signal": 15,
        "stop_timeout": spec.stop_timeout_s,
    }
    if spec.restart_policy != "no":
        body["restart_policy"] = spec.restart_policy
        if spec.restart_policy == "on-failure" and spec.restart_retries:
            body["restart_tries"] = spec.restart_retries
    if spec.network == "host":
        body["netns"] = {"nsmode": "host"}
    elif spec.network:
        body["netns"] = {"nsmode": "bridge"}
        body["networks"] = {spec.network: {"aliases": list(spec.aliases)} if spec.aliases else {}}
    else:
        body["netns"] = {"nsmode": "bridge"}
    if spec.gpus:
        body["devices"] = [{"path": name} for name in spec.gpus]
    if spec.ports:
        body["portmappings"] = [
            {
                "container_port": p,
                "host_ip": spec.bind_address,
                "protocol": "tcp",
                **({"host_port": spec.host_ports[p]} if p in spec.host_ports else {}),
            }
            for p in spec.ports
        ]
    if spec.workdir:
        body["work_dir"] = spec.workdir
    if spec.user:
        body["user"] = spec.user
    if spec.shm_size_mb:
        body["shm_size"] = spec.shm_size_mb << 20
    if spec.memory_mb:
        body["resource_limits"] = {"memory": {"limit": spec.memory_mb << 20}}
    if spec.healthcheck:
        h = spec.healthcheck
        body["healthconfig"] = {
            "Test": ["CMD", *h.command],
            "Interval": _ns(h.interval_s),
            "Timeout": _ns(h.timeout_s),
            "Retries": h.retries,
            "StartPeriod": _ns(h.start_period_s),
        }
    return body


def container_exit_reason(
    exit_code: int | None, *, oom_killed: bool, memory_mb: int | None, program: str = ""
) -> tuple[str, str]:
    """(our state, an actionable reason) for a container that exited with ``exit_code``."""
    if oom_killed:
        limit = f"its memory limit ({memory_mb} MiB)" if memory_mb else "the host's memory"
        return "OUT_OF_MEMORY", (
            f"the container was killed for exceeding {limit} (OOMKilled): raise resources.mem_gb, or lower the batch "
            "size / the number of data-loader workers"
        )
    if exit_code == 137 and memory_mb:
        return "OUT_OF_MEMORY", (
            f"the container was killed (SIGKILL, exit 137), most likely for exceeding its memory limit ({memory_mb} "
            "MiB; some engines, podman on cgroup v1 among them, do not report OOMKilled): raise resources.mem_gb, or "
            "lower the batch size / the number of data-loader workers. Else a stop whose grace period "
            "(stop_timeout_seconds) ran out killed it"
        )
    if exit_code == 137:
        return "FAILED", (
            "the container was killed (SIGKILL, exit 137) without the engine reporting OOMKilled: the host's OOM "
            "killer, or a stop whose grace period (stop_timeout_seconds) ran out before the job exited; see the log"
        )
    if exit_code == 125:
        return "FAILED", "the engine could not run the container (exit 125): see the engine's error in the log"
    if exit_code == 126:
        return "FAILED", f"the command {program!r} cannot be run in the image (exit 126: not executable)"
    if exit_code == 127:
        return "FAILED", (
            f"the command {program!r} is not in the image (exit 127): check train.command and the image's PATH"
        )
    return "FAILED", explain_exit_code(exit_code)
