"""The Secret a deploy makes for its pods: the checkpoint store's credentials, through the API only.

``k8s_manifests.store_secret`` builds it (``<service>-model-store``, labelled as gpuferry's); here it is
created, updated when its values changed, or left as it is, and deleted with the service. A Secret of that
name that gpuferry did not make is never touched: the deploy stops with an error saying how to use it or
clear the name. The values go only into the API's request bodies (never a command line, a log or a file).
"""

from __future__ import annotations

from typing import Any

from blocks import k8s_manifests as manifests
from blocks.errors import ConfigurationError
from blocks.k8s_api import KubeApi


def _path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/secrets/{name}"


def put_store_secret(api: KubeApi, wanted: dict[str, Any] | None) -> tuple[str, str] | None:
    """Create or update ``wanted`` (None: the store needs nothing); returns its name and resourceVersion, which
    the pod template records so that changed credentials restart the pods."""
    if wanted is None:
        return None
    namespace, name = wanted["metadata"]["namespace"], wanted["metadata"]["name"]
    path = _path(namespace, name)
    found = api.get_or_none(path)
    if found is None:
        made = api.request("POST", path.rsplit("/", 1)[0], body=wanted)
    elif not manifests.is_ours(found):
        raise ConfigurationError(
            f"Secret {namespace}/{name} exists and is not gpuferry's (no app.kubernetes.io/managed-by="
            f"{manifests.MANAGED_BY} label): name it in env_from_secret to use it, or delete it"
        )
    elif found.get("data") == wanted["data"] and found["metadata"].get("labels") == wanted["metadata"]["labels"]:
        made = found
    else:
        wanted = {**wanted, "metadata": {**wanted["metadata"], "resourceVersion": found["metadata"]["resourceVersion"]}}
        made = api.request("PUT", path, body=wanted)
    return name, made["metadata"]["resourceVersion"]


def delete_store_secret(api: KubeApi, namespace: str, name: str) -> None:
    """Delete the store's Secret ``name`` if gpuferry made it."""
    path = _path(namespace, name)
    if manifests.is_ours(api.get_or_none(path) or {}):
        api.delete(path)
