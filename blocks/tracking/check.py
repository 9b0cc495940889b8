"""The checks of the MLflow server (``MlflowTracking.self_check``): it answers, its login is accepted, the
experiment and the registry can be read.

Clients are made here with the probe's deadline as their timeout and no retries of their own: a check says at
once what does not answer instead of retrying it for minutes as a pipeline step would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from blocks.checks import CheckFailed, Probe, Warn, reach_url, writable_dir

if TYPE_CHECKING:
    from blocks.tracking.mlflow import MlflowTracking


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
    from blocks.tracking.mlflow import sqlite_path

    uri = tracking.tracking_uri
    if not uri.startswith(("http://", "https://")):
        path = sqlite_path(uri)
        where = path or uri
        probe.step("local store", lambda: writable_dir(where), "set tracking_uri to a writable path or a server")
        probe.skip(
            "webhooks",
            "a local store has no server to call webhooks: the registry poller "
            "(deployments/poll_registry.py) watches it",
        )
        return
    if not reach_url(probe, uri, "start the MLflow server, or fix tracking_uri"):
        return
    base = uri.rstrip("/")
    with probe.local():  # the login comes through MLflow's own settings: importing it takes seconds
        auth = _mlflow_auth(tracking)
    http = httpx.Client(timeout=probe.left, auth=auth)

    def get(path: str, what: str) -> httpx.Response:
        response = http.get(f"{base}{path}")
        if response.status_code in (401, 403):
            raise CheckFailed(
                f"{what}: HTTP {response.status_code} from {base}",
                "set tracking.username + tracking.password (basic auth) or tracking.token to an account of this server",
            )
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
            probe.step(
                "registry",
                lambda: seen("registered-models", "registered_models", "registered models"),
                "the server must run with a database backend store (the registry needs one)",
            )

        def webhooks() -> Any:
            response = get("/api/2.0/mlflow/webhooks?max_results=1", "webhooks")
            if response.status_code != 200:
                return Warn(
                    f"no webhooks (HTTP {response.status_code}): alias changes reach Prefect only by polling",
                    "MLflow 3.3+ with a SQL backend store has webhooks; else run deployments/poll_registry.py",
                )
            return "webhooks supported (alias changes reach Prefect at once)"

        probe.step("webhooks", webhooks)
    finally:
        http.close()
