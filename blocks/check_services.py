"""The checks of the HTTP services a stack names: the S3 bucket, the MLflow server, the image registry and engine.

Each function is one block's ``self_check`` (``blocks/checks.py`` has the rows and the runner). Clients are
made here with the probe's deadline as their timeout and no retries of their own: a check says at once what
does not answer instead of retrying it for minutes as a pipeline step would.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx

from blocks.checks import PROBE_PREFIX, CheckFailed, Probe, Warn, tcp_reach, writable_dir

if TYPE_CHECKING:
    from blocks.docker_image import DockerImageBuilder
    from blocks.s3 import S3CheckpointStore
    from blocks.tracking import MlflowTracking


def _reach_url(probe: Probe, url: str, fix: str) -> bool:
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return probe.step("reach", lambda: tcp_reach(parsed.hostname or "", port, probe.left), fix)


# ---- S3 ------------------------------------------------------------------------------------------------


def _s3_client(store: S3CheckpointStore, timeout: float) -> Any:
    from botocore.config import Config

    credentials = store.bucket.credentials
    params = credentials.aws_client_parameters.get_params_override()
    config = params.pop("config", None) or Config()
    params["config"] = config.merge(Config(connect_timeout=timeout, read_timeout=timeout,
                                           retries={"max_attempts": 1, "mode": "standard"}))  # fmt: skip
    if getattr(credentials, "region_name", None):
        params["region_name"] = credentials.region_name
    return credentials.get_boto3_session().client("s3", **params)


def _s3_code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""


def check_s3(store: S3CheckpointStore, probe: Probe) -> None:
    """The endpoint answers, the bucket exists and takes the credentials, and a probe object can be put, read
    back and deleted under the store's prefix."""
    bucket = store.bucket.bucket_name
    endpoint = store.bucket.credentials.aws_client_parameters.endpoint_url
    if endpoint and not _reach_url(probe, str(endpoint), "start the S3 server, or fix "
                                   "bucket.credentials.aws_client_parameters.endpoint_url"):
        return
    client = _s3_client(store, probe.left)

    def exists() -> str:
        try:
            client.head_bucket(Bucket=bucket)
        except Exception as exc:  # noqa: BLE001 - botocore's errors, named by their code
            code = _s3_code(exc)
            if code in ("404", "NoSuchBucket"):
                raise CheckFailed(f"bucket {bucket!r} does not exist",
                                  f"create it (`aws s3 mb s3://{bucket}`), or fix bucket.bucket_name") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise CheckFailed(f"bucket {bucket!r}: access denied ({code})",
                                  "fix bucket.credentials, or grant them s3:ListBucket on the bucket") from None
            raise
        return f"s3://{bucket} ({client.meta.endpoint_url})"

    if not probe.step("bucket", exists, "check the endpoint and bucket.credentials"):
        return
    folder = "/".join(p.strip("/") for p in (store.bucket.bucket_folder, store.prefix) if p.strip("/"))
    key = "/".join(p for p in (folder, f"{PROBE_PREFIX}{probe.probe_id}") if p)
    body = secrets.token_bytes(32)

    def put_get_delete() -> str:
        started = time.monotonic()
        client.put_object(Bucket=bucket, Key=key, Body=body)
        try:
            read = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            if read != body:
                raise CheckFailed(f"s3://{bucket}/{key} read back {len(read)} bytes that differ from the 32 put",
                                  "the store corrupts objects: check its configuration")  # fmt: skip
        finally:
            client.delete_object(Bucket=bucket, Key=key)
        return f"put, get and delete of s3://{bucket}/{key} ({(time.monotonic() - started) * 1000:.0f} ms)"

    probe.step("put, get, delete", put_get_delete, "grant the credentials s3:PutObject, s3:GetObject and "
               "s3:DeleteObject under the store's prefix")


# ---- MLflow --------------------------------------------------------------------------------------------


def _mlflow_auth(tracking: MlflowTracking) -> httpx.Auth | None:
    """The login the block's own client sends: the block's, else MLflow's variables of this environment."""
    creds = tracking.host_creds(tracking.tracking_uri)
    if creds.username and creds.password:
        return httpx.BasicAuth(creds.username, creds.password)
    if creds.token:
        return _Bearer(creds.token)
    return None


class _Bearer(httpx.Auth):
    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def auth_flow(self, request: httpx.Request) -> Any:
        request.headers["Authorization"] = self._header
        yield request


def check_mlflow(tracking: MlflowTracking, probe: Probe) -> None:
    """The tracking server answers (its version), its tracking and registry APIs, and whether it has webhooks;
    for a local store, that its directory is writable."""
    from blocks.tracking import sqlite_path

    uri = tracking.tracking_uri
    if not uri.startswith(("http://", "https://")):
        path = sqlite_path(uri)
        where = path or uri
        probe.step("local store", lambda: writable_dir(where), "set tracking_uri to a writable path or a server")
        probe.skip("webhooks", "a local store has no server to call webhooks: the registry poller "
                   "(deployments/poll_registry.py) watches it")  # fmt: skip
        return
    if not _reach_url(probe, uri, "start the MLflow server, or fix tracking_uri"):
        return
    base = uri.rstrip("/")
    with probe.local():  # the login comes through MLflow's own settings: importing it takes seconds
        auth = _mlflow_auth(tracking)
    http = httpx.Client(timeout=probe.left, auth=auth)

    def get(path: str, what: str) -> httpx.Response:
        response = http.get(f"{base}{path}")
        if response.status_code in (401, 403):
            raise CheckFailed(f"{what}: HTTP {response.status_code} from {base}",
                              "set tracking.username + tracking.password (basic auth) or tracking.token to an "
                              "account of this server")  # fmt: skip
        return response

    def server() -> str:
        health = get("/health", "health")
        if health.status_code != 200:
            raise CheckFailed(f"{base}/health answered HTTP {health.status_code}: {health.text[:200]}")
        version = get("/version", "version")
        return f"{base} (MLflow {version.text.strip()[:40] if version.status_code == 200 else 'version unknown'})"

    try:
        if not probe.step("server", server, "fix tracking_uri: it must be an MLflow tracking server"):
            return

        def api(path: str, what: str) -> Any:
            response = get(path, what)
            if response.status_code != 200:
                raise CheckFailed(f"{what}: HTTP {response.status_code}: {response.text[:200]}")
            return response.json()

        def seen(path: str, key: str, what: str) -> str:
            return f"{what} answer ({len(api(f'/api/2.0/mlflow/{path}/search?max_results=1', what).get(key, []))} seen)"

        probe.step("tracking", lambda: seen("experiments", "experiments", "experiments"))
        registry = (tracking.registry_uri or uri).rstrip("/")
        if registry != base:
            probe.info("registry", f"a separate registry: {registry} (not checked here)")
        else:
            probe.step("registry", lambda: seen("registered-models", "registered_models", "registered models"),
                       "the server must run with a database backend store (the registry needs one)")

        def webhooks() -> Any:
            response = get("/api/2.0/mlflow/webhooks?max_results=1", "webhooks")
            if response.status_code != 200:
                return Warn(f"no webhooks (HTTP {response.status_code}): alias changes reach Prefect only by polling",
                            "MLflow 3.3+ with a SQL backend store has webhooks; else run deployments/poll_registry.py")
            return "webhooks supported (alias changes reach Prefect at once)"

        probe.step("webhooks", webhooks)
    finally:
        http.close()


# ---- the image builder ---------------------------------------------------------------------------------


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
        name = next((c.get("Name", "") for c in version.get("Components", []) if "podman" in c.get("Name", "").lower()),
                    "") or "Docker Engine"  # fmt: skip
        return f"{name} {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at " \
            f"{builder.docker_host.base_url or os.environ.get('DOCKER_HOST') or 'the default socket'}"  # fmt: skip

    probe.step("engine", engine, "start the engine (Docker, or `podman system service`), or fix docker_host.base_url")
    registry_url = builder._registry_base_url()
    if not _reach_url(probe, registry_url, "start the registry, or fix credentials.registry_url"):
        return
    from blocks.docker_image import RegistryClient

    creds = builder.credentials
    client = RegistryClient(registry_url, creds.username, creds.password.get_secret_value(), timeout_s=probe.left)
    try:
        if not probe.step("registry login", lambda: client.check_login(),
                          "fix credentials.username / credentials.password"):
            return
        probe.step("push permission", lambda: client.check_push(builder.repository),
                   f"grant {builder.credentials.username!r} push on {builder.repository}")
    finally:
        client.close()
