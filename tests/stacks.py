"""Connection settings of the local stacks that `make <stack>-up` starts (scripts/<stack>.sh)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest


def stacks_root() -> Path:
    default = Path(os.environ.get("GPUFERRY_CACHE", Path.home() / ".cache" / "gpuferry")) / "stacks"
    return Path(os.environ.get("GPUFERRY_STACKS", default))


def stack_env(name: str) -> dict[str, str]:
    """The KEY=VALUE lines `scripts/<name>.sh up` wrote, or skip/fail when the stack is not up.

    Under `make test` (GPUFERRY_REQUIRE_STACKS=1) a missing stack fails the test: `make test`
    starts every stack, so a missing one is a bug, not a reason to skip.
    """
    path = stacks_root() / name / "env"
    if not path.exists():
        message = f"the {name} stack is not up: run `make {name}-up` ({path} missing)"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def s3_store(bucket: str, create: bool = True):  # type: ignore[no-untyped-def]
    """An S3CheckpointStore on ``bucket`` of the s3 stack (created when missing)."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    from blocks.storage.s3 import S3CheckpointStore

    env = stack_env("s3")
    credentials = AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=env["S3_ENDPOINT_URL"]),
    )
    if create:
        s3 = credentials.get_s3_client()
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=bucket)
    return S3CheckpointStore(bucket=S3Bucket(bucket_name=bucket, credentials=credentials))


class Relay:
    """TCP relay from ``listen_host``:<free port> to ``target`` (host, port), one thread per connection."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = self._listen(listen_host)
        self.address = self.server.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _listen(self, host: str) -> socket.socket:
        return socket.create_server((host, 0))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=30)
        except OSError:
            client.close()
            return
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


def s3_seen_from(relay: Relay) -> dict[str, str]:
    """The s3 stack's endpoint as reached through ``relay``, and its credentials: what a container is given."""
    env = stack_env("s3")
    return {
        "AWS_ENDPOINT_URL": f"http://{relay.address[0]}:{relay.address[1]}",
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": env["AWS_DEFAULT_REGION"],
    }


def s3_target() -> tuple[str, int]:
    """The s3 stack's (host, port) on this machine."""
    from urllib.parse import urlsplit

    url = urlsplit(stack_env("s3")["S3_ENDPOINT_URL"])
    return url.hostname or "127.0.0.1", url.port or 80


def host_address() -> str:
    """This machine's address on its default route: containers on podman's bridge reach the host there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # a UDP "connect" only picks the route; nothing is sent
        return s.getsockname()[0]


def registry_login(password: str | None = None):  # type: ignore[no-untyped-def]
    """The registry stack's login as a DockerRegistryCredentials block (``password``: another one, to fail)."""
    from prefect_docker.credentials import DockerRegistryCredentials

    reg = stack_env("registry")
    return DockerRegistryCredentials(
        username=reg["REGISTRY_USER"],
        password=password or Path(reg["REGISTRY_PASSWORD_FILE"]).read_text().strip(),
        registry_url=f"http://{reg['REGISTRY_URL']}",
    )


def slurm_login() -> dict[str, object]:
    """The SlurmCluster fields that reach the slurm stack's login node over SSH (its key, host key, partition)."""
    from pydantic import SecretStr

    from blocks.ssh.credentials import SshCredentials

    slurm = stack_env("slurm")
    credentials = SshCredentials(
        user=slurm["SLURM_SSH_USER"],
        private_key=SecretStr(Path(slurm["SLURM_SSH_KEY"]).read_text()),
        known_hosts=Path(slurm["SLURM_KNOWN_HOSTS"]).read_text(),
    )
    return {
        "host": slurm["SLURM_SSH_HOST"],
        "port": int(slurm["SLURM_SSH_PORT"]),
        "credentials": credentials,
        "slurm_conf": slurm["SLURM_CONF"],
        "partition": slurm["SLURM_PARTITION"],
    }


def cluster_dir(name: str) -> str:
    """A new job directory root on the slurm stack's own filesystem: a path that does not exist on this machine
    (scripts/slurm.sh mounts it in the cluster's mount namespace only), as on a remote cluster."""
    import uuid

    root = f"{stack_env('slurm')['SLURM_CLUSTER_DIR']}/{name}-{uuid.uuid4().hex[:8]}"
    assert not Path(root).parent.exists(), f"{root} must not exist for the orchestrator"
    return root


def remote_slurm(name: str, **fields):  # type: ignore[no-untyped-def]
    """The slurm stack as a remote cluster: over SSH, job directories on the cluster's own filesystem and the
    cluster's own Python (Debian's python3 in a venv of the cluster's, not this process's interpreter).
    ``fields`` override the block's settings."""
    from blocks.slurm.cluster import SlurmCluster

    settings = {
        **slurm_login(),
        "workdir_root": cluster_dir(name),
        "python": stack_env("slurm")["SLURM_CLUSTER_PYTHON"],
        **fields,
    }
    return SlurmCluster(**settings)


def remove_on_cluster(cluster, path: str) -> None:  # type: ignore[no-untyped-def]
    """Remove ``path`` on the cluster's filesystem (through the block's SSH session), unless GPUFERRY_KEEP_JOBS=1."""
    if os.environ.get("GPUFERRY_KEEP_JOBS") != "1":
        cluster.run(["rm", "-rf", "--", path], check=False)


def mlflow_server(**fields):  # type: ignore[no-untyped-def]
    """An MlflowTracking block on the mlflow stack's server (artifacts proxied by the server to its S3 bucket),
    logged in as the stack's tests user: what a job on a remote cluster can log to. Its ``client`` is an
    MlflowClient with that login (``mlflow_server().client``). ``fields`` override the block's settings."""
    from pydantic import SecretStr

    from blocks.tracking.mlflow import MlflowTracking

    env = stack_env("mlflow")
    settings = {
        "tracking_uri": env["MLFLOW_TRACKING_URI"],
        "artifact_location": None,
        "username": env["MLFLOW_TRACKING_USERNAME"],
        "password": SecretStr(env["MLFLOW_TRACKING_PASSWORD"]),
        **fields,
    }
    return MlflowTracking(**settings)


def mlflow_login_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's own variables (MLFLOW_TRACKING_USERNAME / PASSWORD) set to the mlflow stack's login for one test:
    for what MLflow reads from the environment only, whichever client asks (artifact transfers through the
    server's proxy, mlflow-artifacts:/)."""
    env = stack_env("mlflow")
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, env[name])


def slurm_for_images(workdir_root: str | Path, **fields):  # type: ignore[no-untyped-def]
    """The slurm stack as a stack file would declare it for jobs in the workload's image: over SSH, each job
    pulling the image with the registry stack's login and running it with podman (the stack's nodes have
    podman, and stand-in GPUs passed as CUDA_VISIBLE_DEVICES). ``fields`` override the block's settings."""
    from blocks.slurm.cluster import SlurmCluster

    reg = stack_env("registry")
    settings: dict[str, object] = dict(
        **slurm_login(),
        workdir_root=str(workdir_root),
        container_runtime="podman",
        podman_gpu_mode="env",
        container_runtime_env={
            k: reg[k] for k in ("CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF")
        },
        registry_credentials=registry_login(),
    )
    settings.update(fields)
    return SlurmCluster(**settings)
