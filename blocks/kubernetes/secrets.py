"""The Secret a deploy makes for its pods: the checkpoint store's credentials, through the API only.

``k8s_manifests.store_secret`` builds it (``<service>-model-store``, labelled as gpuferry's) of the release's
``store_env`` and of the store's CA certificate, read here from the file its ``AWS_CA_BUNDLE`` names on this
machine (the pods get it as a file of their own); here it is created, updated when its values changed, or left
as it is, and deleted with the service. A Secret of that
name that gpuferry did not make is never touched: the deploy stops with an error saying how to use it or
clear the name. The values go only into the API's request bodies (never a command line, a log or a file).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from blocks.errors import ConfigurationError
from blocks.kubernetes import manifests
from blocks.kubernetes.api import KubeApi
from blocks.specs import ServingSpec
from runtime.s3_errors import CA_FIELD


def store_secret_for(
    spec: ServingSpec, store_env: Mapping[str, SecretStr], opts: manifests.ManifestOptions
) -> dict[str, Any] | None:
    """The store's Secret for ``spec``'s pods: ``store_env``'s variables and the CA certificate (PEM) of the file
    its AWS_CA_BUNDLE names here, unless the block's ``env`` gives the pods an AWS_CA_BUNDLE of their own."""
    values = {k: v.get_secret_value() for k, v in store_env.items()}
    path = values.get("AWS_CA_BUNDLE")
    ca = None
    if path and "AWS_CA_BUNDLE" not in opts.env:
        try:
            ca = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigurationError(
                f"{CA_FIELD} ({path}): the pods are given the store's CA certificate, which cannot be read here: {exc}"
            ) from None
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ConfigurationError(
                f"{CA_FIELD} ({path}) holds no PEM certificate (-----BEGIN CERTIFICATE-----): "
                "name the CA certificate that signed the store's TLS certificate"
            )
    return manifests.store_secret(spec, values, opts, ca_bundle=ca)


def put_store_secret(api: KubeApi, wanted: dict[str, Any] | None) -> tuple[str, str] | None:
    """Create or update ``wanted`` (None: the store needs nothing); returns its name and resourceVersion, which
    the pod template records so that changed credentials restart the pods."""
    if wanted is None:
        return None
    namespace, name = wanted["metadata"]["namespace"], wanted["metadata"]["name"]
    found = api.read_or_none("v1", "Secret", name, namespace=namespace)
    if found is None:
        made = api.create(wanted)
    elif not manifests.is_ours(found):
        raise ConfigurationError(
            f"Secret {namespace}/{name} exists and is not gpuferry's (no app.kubernetes.io/managed-by="
            f"{manifests.MANAGED_BY} label): name it in env_from_secret to use it, or delete it"
        )
    elif found.get("data") == wanted["data"] and found["metadata"].get("labels") == wanted["metadata"]["labels"]:
        made = found
    else:
        wanted = {**wanted, "metadata": {**wanted["metadata"], "resourceVersion": found["metadata"]["resourceVersion"]}}
        made = api.replace(wanted)
    return name, made["metadata"]["resourceVersion"]


def delete_store_secret(api: KubeApi, namespace: str, name: str) -> None:
    """Delete the store's Secret ``name`` if gpuferry made it."""
    if manifests.is_ours(api.read_or_none("v1", "Secret", name, namespace=namespace) or {}):
        api.remove("v1", "Secret", name, namespace=namespace)
