"""A small Kubernetes REST client: connection from a kubeconfig (or in-cluster), JSON in and out,
bounded retries of transient failures, and errors that say what to do.

The official client's generated models are not used: they validate every answer against the newest
API's schema, and an older server's answers (a Service DELETE answering a ``Status``) fail that
validation. Every call here is idempotent (GET, server-side apply, DELETE), so a retry after a 5xx,
a 429 or a timeout cannot apply anything twice.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from blocks.backoff import retry_delay
from blocks.errors import ConfigurationError, GpuferryError, TransientError

APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: server-side apply takes a JSON body
MERGE_PATCH = "application/merge-patch+json"

_TRANSIENT_STATUS = {429, 500, 502, 503, 504}


class KubeApiError(GpuferryError):
    """The API server refused a request (4xx other than the transient ones)."""

    def __init__(self, message: str, *, status: int, reason: str = "", body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.body = body or {}


class NotFound(KubeApiError):
    """404: the object (or the API) does not exist."""


class ApplyConflict(KubeApiError, ConfigurationError):
    """409 on server-side apply: another field manager owns a field we set."""


@dataclass
class Connection:
    """Where the API server is and how to authenticate; built by ``connection_from_*``."""

    server: str
    verify: ssl.SSLContext | bool
    headers: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None  # the kubeconfig context's namespace, if any
    token_refresh: Any = None  # callable returning headers (in-cluster tokens rotate)


def connection_from_kubeconfig(content: str, context: str | None = None) -> Connection:
    """A connection from kubeconfig YAML (certificates inline or as files, tokens, exec plugins)."""
    import yaml
    from kubernetes.client import Configuration
    from kubernetes.config import kube_config
    from kubernetes.config.config_exception import ConfigException

    try:
        loaded = yaml.safe_load(content)
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"kubeconfig is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict) or not loaded.get("clusters"):
        raise ConfigurationError("kubeconfig has no clusters: paste the whole kubeconfig file into the block's kubeconfig")
    cfg = Configuration()
    try:
        loader = kube_config.KubeConfigLoader(config_dict=loaded, active_context=context)
        loader.load_and_set(cfg)
        namespace = (loader.current_context.get("context") or {}).get("namespace")
    except ConfigException as exc:
        raise ConfigurationError(f"kubeconfig (context={context!r}): {exc}") from None
    return _connection(cfg, namespace)


def connection_in_cluster() -> Connection:
    """A connection from the pod's service account (the block runs inside the cluster)."""
    from kubernetes.client import Configuration
    from kubernetes.config import incluster_config
    from kubernetes.config.config_exception import ConfigException

    cfg = Configuration()
    try:
        loader = incluster_config.InClusterConfigLoader(
            token_filename=incluster_config.SERVICE_TOKEN_FILENAME, cert_filename=incluster_config.SERVICE_CERT_FILENAME
        )
        loader.load_and_set(cfg)
    except ConfigException as exc:
        raise ConfigurationError(
            f"no kubeconfig was given and this is not a pod with a service account ({exc}): "
            "set the block's kubeconfig"
        ) from None
    try:
        with open(incluster_config.SERVICE_TOKEN_FILENAME.replace("token", "namespace")) as fh:
            namespace = fh.read().strip() or None
    except OSError:
        namespace = None

    def refresh() -> dict[str, str]:
        if cfg.refresh_api_key_hook:
            cfg.refresh_api_key_hook(cfg)
        return _auth_headers(cfg)

    conn = _connection(cfg, namespace)
    conn.token_refresh = refresh
    return conn


def _auth_headers(cfg: Any) -> dict[str, str]:
    # The loaders keep a token (kubeconfig `token`, an exec plugin's, in-cluster) as "BearerToken"; older
    # clients as "authorization": read it as the client's own auth_settings() does.
    token = cfg.get_api_key_with_prefix("BearerToken", alias="authorization") if cfg.api_key else None
    if token:
        return {"Authorization": token}
    if cfg.username or cfg.password:
        return {"Authorization": cfg.get_basic_auth_token()}
    return {}


def _connection(cfg: Any, namespace: str | None) -> Connection:
    verify: ssl.SSLContext | bool
    if cfg.verify_ssl:
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
        if cfg.tls_server_name:
            raise ConfigurationError("kubeconfig tls-server-name is not supported; use a server address in the certificate")
    else:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    verify = ctx
    return Connection(server=cfg.host.rstrip("/"), verify=verify, headers=_auth_headers(cfg), namespace=namespace)


class KubeApi:
    """JSON over HTTPS to one API server, with bounded retries of transient failures."""

    def __init__(
        self, conn: Connection, *, timeout: float = 30.0, retries: int = 4, backoff: float = 0.5, user_agent: str = "gpuferry"
    ) -> None:
        self.conn = conn
        self.retries = retries
        self.backoff = backoff
        self._client = httpx.Client(
            base_url=conn.server, verify=conn.verify, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers={"Accept": "application/json", "User-Agent": user_agent},
        )  # fmt: skip
        self.attempts = 0  # every HTTP attempt made (tests read it)

    def close(self) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; retry 429/5xx/timeouts/connection errors; raise ``KubeApiError`` otherwise."""
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(retry_delay(attempt, self.backoff))
            headers = self._headers(content_type if data is not None else None)
            self.attempts += 1
            try:
                response = self._client.request(method, path, content=data, params=params, headers=headers)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code == 500 and "failed to create typed patch object" in response.text:
                # The server cannot merge our object (a schema mismatch): the same body fails again.
                raise KubeApiError(
                    f"{method} {path}: the API server cannot apply this object: {_message(response)}",
                    status=500, reason="InternalError",
                )
            if response.status_code in _TRANSIENT_STATUS:
                last = f"HTTP {response.status_code}: {_message(response)}"
                retry_after = response.headers.get("Retry-After", "")
                if retry_after.isdigit():
                    time.sleep(min(int(retry_after), 10))
                continue
            if response.status_code >= 400:
                raise _error(method, path, response)
            if not response.content:
                return {}
            try:
                return response.json()
            except ValueError:
                raise TransientError(f"{method} {path}: the API server answered non-JSON: {response.text[:200]}") from None
        raise TransientError(
            f"{method} {self.conn.server}{path} failed {self.retries + 1} times; last: {last}. "
            "Is the API server up and reachable?"
        )

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = dict(self.conn.token_refresh() if self.conn.token_refresh else self.conn.headers)
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def proxy(self, path: str, body: Any = None, *, timeout: float | None = None) -> httpx.Response:
        """One request through the API server's proxy subresource (``.../pods/NAME:PORT/proxy/...``): POST
        ``body`` as JSON, or GET when it is None. Returns the answer whatever its status: the server behind
        the proxy answered it, or the API server did when it could not reach that server (502/503 with a
        ``Status``). Only failing to reach the API server is retried."""
        data = None if body is None else json.dumps(body).encode()
        method = "GET" if body is None else "POST"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(retry_delay(attempt, self.backoff))
            self.attempts += 1
            try:
                response = self._client.request(
                    method, path, content=data, headers=self._headers("application/json" if data else None),
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )  # fmt: skip
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            return response
        raise TransientError(f"{method} {self.conn.server}{path}: cannot reach the API server ({last})")

    # -- conveniences
    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.request("GET", path, params=params or None)

    def get_or_none(self, path: str, **params: Any) -> dict[str, Any] | None:
        try:
            return self.get(path, **params)
        except NotFound:
            return None

    def apply(self, path: str, manifest: dict[str, Any], *, field_manager: str, force: bool = False) -> dict[str, Any]:
        params = {"fieldManager": field_manager}
        if force:
            params["force"] = "true"
        return self.request("PATCH", path, body=manifest, params=params, content_type=APPLY_PATCH)

    def delete(self, path: str, **params: Any) -> bool:
        try:
            self.request("DELETE", path, params=params or None)
        except NotFound:
            return False
        return True


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    return str(body.get("message") or body)[:500] if isinstance(body, dict) else str(body)[:300]


def _error(method: str, path: str, response: httpx.Response) -> KubeApiError:
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:500]}
    body = body if isinstance(body, dict) else {"message": str(body)}
    status, reason, message = response.status_code, body.get("reason", ""), body.get("message", "")
    where = f"{method} {path}"
    if status == 404:
        return NotFound(f"{where}: not found: {message}", status=status, reason=reason, body=body)
    if status == 409 and response.request.headers.get("Content-Type") == APPLY_PATCH:
        causes = body.get("details", {}).get("causes", [])
        owners = "; ".join(f"{c.get('field', '?')}: {c.get('message', '')}" for c in causes) or message
        return ApplyConflict(
            f"server-side apply conflict on {path}: fields we set are owned by another field manager ({owners}). "
            "Let that manager give them up (or remove them from its configuration), or set force_conflicts=true "
            "on the KubernetesCluster block to take them over",
            status=status, reason=reason, body=body,
        )  # fmt: skip
    if status in (401, 403):
        return KubeApiError(
            f"{where}: {'not authenticated' if status == 401 else 'forbidden'}: {message}. "
            "Check the kubeconfig's user and its RBAC permissions in the namespace",
            status=status, reason=reason, body=body,
        )  # fmt: skip
    if status == 422:
        return KubeApiError(f"{where}: the API server rejected the object: {message}", status=status, reason=reason, body=body)
    return KubeApiError(f"{where}: HTTP {status} {reason}: {message}", status=status, reason=reason, body=body)
