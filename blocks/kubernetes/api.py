"""gpuferry's Kubernetes client: the official client's ``DynamicClient``, bounded retries of transient failures,
and errors that say what to do.

The connection comes from a kubeconfig (``kubernetes.config``'s loader: certificates inline or as files, tokens,
exec plugins, ``tls-server-name``) or from the pod's service account (in-cluster; the loader re-reads the rotating
token). Objects are read, listed, created, replaced, server-side applied and deleted by kind through
``kubernetes.dynamic.DynamicClient``, which finds a kind's path by discovery and answers plain JSON. The generated
typed API classes (``CoreV1Api``, ...) are not used: they validate every answer against the newest API's schema,
and an older server's answers fail that validation (a 1.20 server answers a Service DELETE with a ``Status``;
``kubernetes`` 37's ``delete_namespaced_service`` raises on it although the delete succeeded). ``DynamicClient``
only parses JSON, so that DELETE is an ordinary call here (``KubernetesCluster.undeploy`` makes it in
tests/test_kubernetes.py, against a 1.20 server).

Discovery: the first call of a ``KubeApi`` reads ``/version`` and ``/apis``; the first call on an API version (``v1``,
``apps/v1``, ``autoscaling/v2beta2``, ...) reads its resource list. What it read stays in memory for the ``KubeApi``'s
life (``KubernetesCluster`` keeps one per block); it is not written to the library's default cache file in the temporary
directory, which is named by the server's URL alone: clusters behind one URL (a rebuilt cluster, the in-cluster address)
and every local user would share it. The cost, measured on the local 1.20 cluster (loopback, 2 loaded cores): a block's
first deploy makes 16 requests where the hand-written client made 11 (five discovery GETs: ``/version``, ``/api/v1``,
``/apis/apps/v1``, ``/apis/autoscaling/v2beta2``, ``/apis/policy/v1beta1``; discovery's ``/apis`` stands in for the
block's own read of it), about 1-2 ms each here, so the deploy's time stayed within the machine's noise (medians of four
runs of 5-10 first deploys each: 320-470 ms before, 380-460 ms after); a second deploy with the same block makes the
same 10 requests as before. Against a remote API server the five GETs cost five round trips, once per block.

Plain calls on a path (``request``, ``get``, ``apply``, ``delete``: the paths tests and benchmarks build) go through
``DynamicClient.request`` too. One call does not: ``proxy``, a request to a pod through the API server's proxy
subresource, answers whatever the pod's server answers (any status, any content type), where ``DynamicClient``
raises on a non-2xx answer and reads JSON only; it is a plain request through the same ``ApiClient``
(``param_serialize``: authentication, the server's address) with a retry policy of its own.

Retries and errors: ``blocks/kubernetes/transport.py`` (``Transport`` stands in for the ``ApiClient``'s
``rest_client``, so that every request is retried alike, discovery's included).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from blocks.errors import ConfigurationError, TransientError
from blocks.kubernetes.transport import (
    ApplyConflict,
    KubeApiError,
    NoAnswer,
    NotFound,
    Transport,
    conflict,
    error,
    text_of,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.resource import Resource

APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: server-side apply takes a JSON body
MERGE_PATCH = "application/merge-patch+json"

# The errors a caller catches, importable from here as before (they are raised in transport.py).
__all__ = ["ApplyConflict", "Connection", "KubeApi", "KubeApiError", "NoAnswer", "NotFound"]

T = TypeVar("T")


@dataclass
class Connection:
    """Where the API server is and how to authenticate; built by ``connection_from_*``."""

    server: str
    configuration: Configuration  # kubernetes.client.Configuration, as the config loaders set it
    namespace: str | None = None  # the kubeconfig context's namespace, if any


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
        raise ConfigurationError(
            "kubeconfig has no clusters: paste the whole kubeconfig file into the block's kubeconfig"
        )
    cfg = Configuration()
    try:
        loader = kube_config.KubeConfigLoader(config_dict=loaded, active_context=context)
        loader.load_and_set(cfg)
        namespace = (loader.current_context.get("context") or {}).get("namespace")
    except ConfigException as exc:
        raise ConfigurationError(f"kubeconfig (context={context!r}): {exc}") from None
    return Connection(server=cfg.host.rstrip("/"), configuration=cfg, namespace=namespace)


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
        loader.load_and_set(cfg)  # it also sets the hook that re-reads the rotating token
    except ConfigException as exc:
        raise ConfigurationError(
            f"no kubeconfig was given and this is not a pod with a service account ({exc}): set the block's kubeconfig"
        ) from None
    try:
        with open(incluster_config.SERVICE_TOKEN_FILENAME.replace("token", "namespace")) as fh:
            namespace = fh.read().strip() or None
    except OSError:
        namespace = None
    return Connection(server=cfg.host.rstrip("/"), configuration=cfg, namespace=namespace)


@functools.cache
def _in_memory_discoverer() -> type:
    """``LazyDiscoverer`` that never writes its cache file (the module docstring says why)."""
    from kubernetes.dynamic.discovery import LazyDiscoverer

    class InMemoryDiscoverer(LazyDiscoverer):
        def _write_cache(self) -> None:
            pass

    return InMemoryDiscoverer


def _plain(_client: Any, data: Any) -> Any:
    """``DynamicClient``'s serializer: the answer's JSON as it is (no ``ResourceInstance`` wrapper)."""
    return data


class KubeApi:
    """One API server through ``DynamicClient``, with bounded retries of transient failures."""

    def __init__(
        self,
        conn: Connection,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.5,
        user_agent: str = "gpuferry",
    ) -> None:
        from kubernetes.client import ApiClient

        self.conn = conn
        self.retries = retries
        self.backoff = backoff
        conn.configuration.retries = False  # one attempt here is one request: urllib3 retries nothing by itself
        self.client: ApiClient = ApiClient(conn.configuration)
        self.client.user_agent = user_agent
        self._transport = Transport(self.client.rest_client, timeout=timeout, retries=retries, backoff=backoff)
        self.client.rest_client = self._transport  # type: ignore[assignment]  # ApiClient calls request(), close()
        self._dynamic: DynamicClient | None = None
        self._lock = threading.Lock()

    @property
    def attempts(self) -> int:
        """Every HTTP attempt made (tests read it)."""
        return self._transport.attempts

    @property
    def dynamic(self) -> DynamicClient:
        """The ``DynamicClient``, made on first use (it reads ``/version`` and ``/apis``)."""
        with self._lock:
            if self._dynamic is None:
                from kubernetes.dynamic import DynamicClient

                self._dynamic = self._call(
                    "discovery (GET /version, /apis)",
                    lambda: DynamicClient(self.client, discoverer=_in_memory_discoverer()),
                )
            return self._dynamic

    def close(self) -> None:
        self.client.close()

    def _call(self, where: str, call: Callable[[], T]) -> T:
        """``call()``, with the client's errors as gpuferry's."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return call()
        except ResourceNotFoundError as exc:
            raise NotFound(f"{where}: the API server does not serve it ({exc})", status=404) from None
        except ApiException as exc:
            raise error(where, exc.status or 0, exc.body) from None

    # -- by kind (discovery finds the path)
    def resource(self, api_version: str, kind: str) -> Resource:
        """The API resource of ``kind`` in ``api_version`` (``v1``, ``apps/v1``, ...); ``NotFound`` when the server
        does not serve it."""
        prefix = "apis" if "/" in api_version else "api"  # a core kind: only /api/v1 is searched
        return self._call(
            f"{kind} in {api_version}",
            lambda: self.dynamic.resources.get(prefix=prefix, api_version=api_version, kind=kind),
        )

    def read(self, api_version: str, kind: str, name: str, *, namespace: str | None = None) -> dict[str, Any]:
        """The object; ``NotFound`` when it does not exist."""
        res = self.resource(api_version, kind)
        return self._json(
            f"GET {res.path(name=name, namespace=namespace)}",
            lambda: self.dynamic.get(res, name=name, namespace=namespace, serializer=_plain),
        )

    def read_or_none(
        self, api_version: str, kind: str, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.read(api_version, kind, name, namespace=namespace)
        except NotFound:
            return None

    def items(
        self, api_version: str, kind: str, *, namespace: str | None = None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The objects of ``kind`` (in ``namespace``, matching ``label_selector``)."""
        res = self.resource(api_version, kind)
        answer = self._json(
            f"GET {res.path(namespace=namespace)}",
            lambda: self.dynamic.get(res, namespace=namespace, label_selector=label_selector, serializer=_plain),
        )
        return list(answer.get("items") or [])

    def server_side_apply(
        self, manifest: dict[str, Any], *, field_manager: str, force: bool = False, namespace: str | None = None
    ) -> dict[str, Any]:
        """Server-side apply ``manifest`` as ``field_manager``; ``ApplyConflict`` when another manager owns a field
        it sets (unless ``force``)."""
        res = self.resource(manifest["apiVersion"], manifest["kind"])
        namespace = namespace or manifest["metadata"].get("namespace")
        path = res.path(name=manifest["metadata"]["name"], namespace=namespace)
        return self._json(
            f"PATCH {path}",
            lambda: self.dynamic.server_side_apply(
                res,
                body=manifest,
                namespace=namespace,
                field_manager=field_manager,
                force_conflicts="true" if force else None,
                serializer=_plain,
            ),
            apply=True,
        )

    def create(self, manifest: dict[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
        """POST ``manifest`` (a review, such as a SelfSubjectAccessReview, has no metadata)."""
        res = self.resource(manifest["apiVersion"], manifest["kind"])
        namespace = namespace or manifest.get("metadata", {}).get("namespace")
        return self._json(
            f"POST {res.path(namespace=namespace)}",
            lambda: self.dynamic.create(res, body=manifest, namespace=namespace, serializer=_plain),
        )

    def replace(self, manifest: dict[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
        """PUT ``manifest`` (with its ``metadata.resourceVersion``: a concurrent change is a 409, not lost)."""
        res = self.resource(manifest["apiVersion"], manifest["kind"])
        namespace = namespace or manifest["metadata"].get("namespace")
        return self._json(
            f"PUT {res.path(name=manifest['metadata']['name'], namespace=namespace)}",
            lambda: self.dynamic.replace(res, body=manifest, namespace=namespace, serializer=_plain),
        )

    def remove(
        self,
        api_version: str,
        kind: str,
        name: str,
        *,
        namespace: str | None = None,
        propagation_policy: str | None = None,
    ) -> bool:
        """Delete the object; False when it did not exist (or the server does not serve ``kind``)."""
        try:
            res = self.resource(api_version, kind)
            self._json(
                f"DELETE {res.path(name=name, namespace=namespace)}",
                lambda: self.dynamic.delete(
                    res, name=name, namespace=namespace, propagation_policy=propagation_policy, serializer=_plain
                ),
            )
        except NotFound:
            return False
        return True

    def server_version(self) -> dict[str, Any]:
        """The server's ``/version`` (read by discovery)."""
        return dict(self.dynamic.version["kubernetes"])

    def served_versions(self, group: str) -> list[str]:
        """The versions of API ``group`` the server serves (from discovery's ``/apis``)."""
        groups = self._call("GET /apis", lambda: self.dynamic.resources.parse_api_groups(request_resources=False))
        return list(groups.get("apis", {}).get(group, {}))

    # -- by path
    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request to ``path``; retry 429/5xx/timeouts/connection errors; raise ``KubeApiError``
        otherwise."""
        query = [(k, v) for k, v in (params or {}).items() if v is not None]
        return self._json(
            f"{method} {path}",
            lambda: self.dynamic.request(
                method, path, body=body, query_params=query, content_type=content_type, serializer=_plain
            ),
            apply=content_type == APPLY_PATCH,
        )

    def _json(self, where: str, call: Callable[[], Any], *, apply: bool = False) -> dict[str, Any]:
        try:
            answer = self._call(where, call)
        except KubeApiError as exc:
            if apply and exc.status == 409:
                raise conflict(where, exc) from None
            raise
        if answer == "":  # an empty body
            return {}
        if not isinstance(answer, dict):
            raise TransientError(f"{where}: the API server answered non-JSON: {str(answer)[:200]}")
        return answer

    def proxy(self, path: str, body: Any = None, *, timeout: float | None = None) -> tuple[int, Any]:
        """One request through the API server's proxy subresource (``.../pods/NAME:PORT/proxy/...``): POST
        ``body`` as JSON, or GET when it is None. Returns the answer's status and body (its JSON, else its text),
        whatever the status: the server behind the proxy answered it, or the API server did when it could not reach
        that server (502/503 with a ``Status``). Only failing to reach the API server is retried; a request sent and
        not answered is ``NoAnswer``."""
        method = "GET" if body is None else "POST"
        headers = {"Accept": "application/json, */*"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        _, url, headers, body, _ = self.client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self._transport.proxy(method, url, headers, body, timeout)
        text = text_of(response.data)
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    # -- by path, conveniences
    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.request("GET", path, params=params or None)

    def get_or_none(self, path: str, **params: Any) -> dict[str, Any] | None:
        try:
            return self.get(path, **params)
        except NotFound:
            return None

    def apply(self, path: str, manifest: dict[str, Any], *, field_manager: str, force: bool = False) -> dict[str, Any]:
        params = {"fieldManager": field_manager, "force": "true" if force else None}
        return self.request("PATCH", path, body=manifest, params=params, content_type=APPLY_PATCH)

    def delete(self, path: str, **params: Any) -> bool:
        try:
            self.request("DELETE", path, params=params or None)
        except NotFound:
            return False
        return True
