"""The Kubernetes objects of one inference service, built from the typed serving spec (pure: no I/O).

``build_manifests(spec, release, options)`` returns the Deployment, the Service and, when asked
for, a HorizontalPodAutoscaler and a PodDisruptionBudget, as plain dicts ready for server-side
apply. Every knob is a field of ``ManifestOptions``; unknown keys are rejected with the list of
valid ones. The API versions of the optional objects are arguments because the server decides
them (discovery, in ``blocks/kubernetes/cluster.py``). ``store_secret`` is the Secret of the checkpoint store's
credentials the pods read (``envFrom``) when the block names no Secret of the user's (``env_from_secret``);
it also carries the store's CA certificate, which the pods get as a read-only file that ``AWS_CA_BUNDLE`` names.
"""

from __future__ import annotations

import base64
import copy
import math
import re
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blocks.base.serving import SERVER_COMMAND, release_image
from blocks.errors import ConfigurationError
from blocks.records import ServerSpec
from blocks.specs import ServingSpec
from blocks.values import check_quantity
from runtime import contract

PART_OF = "gpuferry"
MANAGED_BY = "gpuferry"
ANNOTATION_PREFIX = "gpuferry.io/"
MODEL_NAME_ANNOTATION = ANNOTATION_PREFIX + "model-name"
MODEL_VERSION_ANNOTATION = ANNOTATION_PREFIX + "model-version"
MODEL_URI_ANNOTATION = ANNOTATION_PREFIX + "model-uri"
# The resourceVersion of the store's Secret the pods were started with: a changed Secret restarts them.
STORE_SECRET_ANNOTATION = ANNOTATION_PREFIX + "store-secret-version"
STORE_SECRET_SUFFIX = "-model-store"
# A reader variable that names a file on the orchestrator's disk, which a pod does not have.
_ORCHESTRATOR_PATHS = ("AWS_CA_BUNDLE",)
# The store's CA certificate (PEM): a key of the store's Secret, mounted read-only at STORE_CA_PATH in the pods.
STORE_CA_KEY = "store-ca.pem"
STORE_CA_DIR = "/etc/gpuferry/store-ca"
STORE_CA_PATH = f"{STORE_CA_DIR}/{STORE_CA_KEY}"
# The route file (runtime/route.py) of gpuferry's server: a key of the service's ConfigMap <name>-route, mounted
# (optional: absent, no route) so that a canary or shadow is set while the pods run (blocks/kubernetes/canary.py).
ROUTE_SUFFIX = "-route"
ROUTE_KEY = "route.json"
ROUTE_DIR = "/etc/gpuferry/route"
# The candidate of a canary or shadow rollout: a Deployment and Service <name>-canary or <name>-shadow, labelled.
TRACK_LABEL = ANNOTATION_PREFIX + "track"
CONTAINER_NAME = "server"
PORT_NAME = "http"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class ManifestOptions(BaseModel):
    """Everything about the objects that the serving spec does not say (the cluster block's fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "default"
    container_port: int = Field(8080, ge=1, le=65535)
    service_port: int = Field(80, ge=1, le=65535)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    gpu_resource: str = "nvidia.com/gpu"
    mig_resource_prefix: str = "nvidia.com/mig-"
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    cpu_request: str | None = "250m"
    memory_request: str | None = "512Mi"
    cpu_limit: str | None = None
    memory_limit: str | None = "2Gi"
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    env_from_secret: str | None = None
    image_pull_secret: str | None = None
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    host_path_mounts: dict[str, str] = Field(default_factory=dict)
    progress_deadline_seconds: int = Field(600, ge=10)
    termination_grace_seconds: int = Field(30, ge=0)
    max_surge: str | int = "25%"
    max_unavailable: str | int = 0
    autoscale_max_replicas: int | None = Field(None, ge=1)
    autoscale_cpu_percent: int = Field(80, ge=1, le=100)
    pdb_min_available: int | str | None = None
    hpa_api_version: str = "autoscaling/v2"
    pdb_api_version: str = "policy/v1"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not _DNS_LABEL.match(value):
            raise ValueError(f"namespace={value!r} is not a DNS label (lowercase letters, digits, '-', at most 63)")
        return value

    @field_validator("gpu_resource")
    @classmethod
    def _gpu_resource(cls, value: str) -> str:
        if not _RESOURCE_NAME.match(value) or "/" not in value:
            raise ValueError(f"gpu_resource={value!r} is not an extended resource name like 'nvidia.com/gpu'")
        return value

    @field_validator("cpu_request", "memory_request", "cpu_limit", "memory_limit")
    @classmethod
    def _quantity(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else check_quantity(value, info.field_name)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"env name {name!r} is not a valid variable name")
        return value

    @field_validator("host_path_mounts")
    @classmethod
    def _mounts(cls, value: dict[str, str]) -> dict[str, str]:
        for host, target in value.items():
            if not host.startswith("/") or not target.startswith("/"):
                raise ValueError(f"host_path_mounts {host!r}: {target!r}: both must be absolute paths")
        return value


def options(**kwargs: Any) -> ManifestOptions:
    """``ManifestOptions(**kwargs)`` with errors that name the field and list the valid ones."""
    unknown = sorted(set(kwargs) - set(ManifestOptions.model_fields))
    if unknown:
        raise ConfigurationError(
            f"unknown manifest option(s) {', '.join(unknown)}; valid: {', '.join(sorted(ManifestOptions.model_fields))}"
        )
    try:
        return ManifestOptions(**kwargs)
    except ValidationError as exc:
        raise ConfigurationError(
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None


def with_shape(opts: ManifestOptions, spec: ServingSpec) -> ManifestOptions:
    """The stack's options with what the service's shape sets over them: its CPU and memory, its autoscaling."""
    shaped: dict[str, Any] = {
        key: getattr(spec, key)
        for key in ("cpu_request", "memory_request", "cpu_limit", "memory_limit")
        if getattr(spec, key) is not None
    }
    if spec.max_replicas is not None:
        shaped["autoscale_max_replicas"] = spec.max_replicas
    if spec.autoscale_cpu_percent is not None:
        shaped["autoscale_cpu_percent"] = spec.autoscale_cpu_percent
    return opts.model_copy(update=shaped) if shaped else opts


def service_object_name(spec: ServingSpec) -> str:
    """The Deployment/Service name: the service name as a DNS label."""
    name = spec.service.lower().replace("_", "-").replace(".", "-")
    if not _DNS_LABEL.match(name):
        raise ConfigurationError(
            f"service_name={spec.service!r} cannot be a Kubernetes object name ({name!r}): use lowercase "
            "letters, digits and '-', starting and ending with a letter or digit"
        )
    return name


def gpu_request(spec: ServingSpec, opts: ManifestOptions) -> tuple[str, int] | None:
    """The extended resource one replica asks for: whole GPUs, a MIG slice, or nothing (CPU)."""
    if spec.mig_profile:
        return f"{opts.mig_resource_prefix}{spec.mig_profile}", 1
    if spec.share_gpus:  # the device plugin's time-sliced GPUs, renamed (renameByDefault): one share per GPU asked
        shared = opts.gpu_resource if opts.gpu_resource.endswith(".shared") else f"{opts.gpu_resource}.shared"
        return shared, spec.gpus or 1
    if spec.gpus:
        return opts.gpu_resource, spec.gpus
    return None


def selector_labels(spec: ServingSpec | str) -> dict[str, str]:
    """The Deployment's selector (of a spec, or of an object name): immutable, so it carries no version."""
    name = spec if isinstance(spec, str) else service_object_name(spec)
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/instance": name}


def label_selector(name: str) -> str:
    """``selector_labels`` as a labelSelector query string."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(spec: ServingSpec, version: str) -> dict[str, str]:
    out = {
        **selector_labels(spec),
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if _LABEL_VALUE.match(version) and len(version) <= 63:
        out["app.kubernetes.io/version"] = version
    return out


def route_config_name(name: str) -> str:
    """The ConfigMap whose ``ROUTE_KEY`` the pods of the service object ``name`` read as their route file."""
    return name + ROUTE_SUFFIX


def store_secret_name(spec: ServingSpec) -> str:
    """The name of the Secret gpuferry makes for the service's pods: the object name + ``-model-store``."""
    return service_object_name(spec) + STORE_SECRET_SUFFIX


def store_secret(
    spec: ServingSpec, reader_env: Mapping[str, str], opts: ManifestOptions, ca_bundle: bytes | None = None
) -> dict[str, Any] | None:
    """The Secret holding what the pods' server needs to read the store (``CheckpointStore.reader_env``): its
    variables less those the block's ``env`` sets (the pod's ``env`` wins over ``envFrom``: e.g. the store's
    endpoint as the pods reach it) and less file paths of the orchestrator's; and ``ca_bundle``, the store's
    CA certificate (the contents of the file AWS_CA_BUNDLE names here), as ``STORE_CA_KEY`` unless the
    block's ``env`` gives the pods an AWS_CA_BUNDLE of their own. None when nothing is left."""
    values = {k: v.encode() for k, v in reader_env.items() if k not in opts.env and k not in _ORCHESTRATOR_PATHS}
    if ca_bundle is not None and "AWS_CA_BUNDLE" not in opts.env:
        values[STORE_CA_KEY] = ca_bundle
    if not values:
        return None
    meta_labels = {
        **selector_labels(spec),
        "app.kubernetes.io/component": "model-store",
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": store_secret_name(spec), "namespace": opts.namespace, "labels": meta_labels},
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(values.items())},
    }


def is_ours(obj: Mapping[str, Any]) -> bool:
    """Whether an object carries gpuferry's managed-by label (made by a deploy, not by someone else)."""
    return obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/managed-by") == MANAGED_BY


def check_image(reference: str | None) -> str:
    """The service's image: there is one, pinned by digest."""
    return release_image(reference, "KubernetesCluster")


def build_manifests(
    spec: ServingSpec,
    *,
    model_name: str,
    version: str,
    model_uri: str,
    image: str | None,
    opts: ManifestOptions,
    server: ServerSpec | None = None,
    checkpoint_sha256: str | None = None,
    store_secret: tuple[str, str] | None = None,
    store_keys: Collection[str] = (),
) -> dict[str, dict[str, Any]]:
    """``{"deployment": ..., "service": ..., ["hpa": ...], ["pdb": ...]}`` for server-side apply.

    ``server`` is what serves the model (the workload's serve section): gpuferry's MLflow model server
    (``python -m runtime.serve`` on ``container_port``) or the workload's own command, port and probe paths.
    ``store_secret`` is (name, resourceVersion) of the store's Secret gpuferry made, ``store_keys`` its keys;
    the pods read it unless ``opts.env_from_secret`` names the user's own.
    """
    server = server or ServerSpec()
    opts = with_shape(opts, spec)
    name = service_object_name(spec)
    image = check_image(image)
    if opts.autoscale_max_replicas is not None and opts.autoscale_max_replicas < spec.replicas:
        raise ConfigurationError(
            f"autoscale_max_replicas={opts.autoscale_max_replicas} is below replicas={spec.replicas}: "
            "raise it or lower replicas"
        )
    all_labels = labels(spec, version)
    annotations = {
        MODEL_NAME_ANNOTATION: model_name,
        MODEL_VERSION_ANNOTATION: version,
        MODEL_URI_ANNOTATION: model_uri,
    }
    port = opts.container_port if server.mlflow_server else server.port
    env = {
        **server.env,
        contract.MODEL_URI: model_uri,
        contract.HOST: "0.0.0.0",
        contract.PORT: str(port),
        contract.MAX_BATCH_SIZE: str(spec.max_batch_size),
        contract.MAX_BATCH_WAIT_MS: _number(spec.max_batch_wait_ms),
        contract.MAX_QUEUE: str(spec.max_queue),
        contract.MODEL_DEVICE: spec.device,
        **({contract.MODEL_SHA256: checkpoint_sha256} if checkpoint_sha256 else {}),
        **opts.env,
    }
    # A Secret with the store's CA: envFrom would make the certificate a variable too (Kubernetes takes any key
    # for a name), so the pods take its variables key by key and the certificate as a file.
    store_ca = bool(store_secret) and not opts.env_from_secret and STORE_CA_KEY in store_keys
    if store_ca:
        env["AWS_CA_BUNDLE"] = STORE_CA_PATH
    resources: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    for key, value in (("cpu", opts.cpu_request), ("memory", opts.memory_request)):
        if value:
            resources["requests"][key] = value
    for key, value in (("cpu", opts.cpu_limit), ("memory", opts.memory_limit)):
        if value:
            resources["limits"][key] = value
    gpu = gpu_request(spec, opts)
    tolerations = list(opts.tolerations)
    if gpu:
        # Extended resources are set as limits (requests default to them and may not differ).
        # Quantities are strings: a 1.20 server cannot server-side apply a number there.
        resources["limits"][gpu[0]] = str(gpu[1])
        # GPU nodes are usually tainted nvidia.com/gpu (MIG and time-sliced ones too).
        for key in dict.fromkeys(("nvidia.com/gpu", gpu[0])):
            toleration = {"key": key, "operator": "Exists", "effect": "NoSchedule"}
            if toleration not in tolerations:
                tolerations.append(toleration)
    else:
        # No GPU asked for: none visible (an image built on CUDA's sets NVIDIA_VISIBLE_DEVICES=all), none taken.
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
        env.setdefault("NVIDIA_VISIBLE_DEVICES", "void")
    resources = {k: v for k, v in resources.items() if v}

    # The server may take ready_timeout_seconds to load and warm up: liveness waits for it.
    startup_failures = max(3, math.ceil(spec.ready_timeout_seconds / 2))
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": opts.image_pull_policy,
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "readinessProbe": {
            "httpGet": {"path": server.readiness_path, "port": PORT_NAME},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
            "successThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": server.health_path, "port": PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "startupProbe": {
            "httpGet": {"path": server.health_path, "port": PORT_NAME},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": startup_failures,
        },
    }
    if opts.command:
        container["command"] = list(opts.command)
    elif server.command:
        container["command"] = list(server.command)
    else:
        container["command"] = list(SERVER_COMMAND)
    if server.workdir:
        container["workingDir"] = server.workdir
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if opts.env_from_secret:
        container["envFrom"] = [{"secretRef": {"name": opts.env_from_secret}}]
    elif store_secret and store_ca:
        # optional: a key a rolled-back template names that the Secret no longer has is left out, as envFrom does.
        refs = [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": store_secret[0], "key": k, "optional": True}}}
            for k in sorted(store_keys)
            if k != STORE_CA_KEY and k not in env
        ]
        container["env"] = refs + container["env"]
        ca_file = {
            "secretName": store_secret[0],
            "optional": True,
            "items": [{"key": STORE_CA_KEY, "path": STORE_CA_KEY}],
        }
        volumes.append({"name": "store-ca", "secret": ca_file})
        mounts.append({"name": "store-ca", "mountPath": STORE_CA_DIR, "readOnly": True})
    elif store_secret:
        container["envFrom"] = [{"secretRef": {"name": store_secret[0]}}]
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": opts.termination_grace_seconds,
    }
    if server.mlflow_server:
        container["env"].append({"name": contract.ROUTE_FILE, "value": f"{ROUTE_DIR}/{ROUTE_KEY}"})
        route = {"name": route_config_name(name), "optional": True}
        volumes.append({"name": "route", "configMap": route})
        mounts.append({"name": "route", "mountPath": ROUTE_DIR, "readOnly": True})
    for i, (host, target) in enumerate(sorted(opts.host_path_mounts.items())):
        volumes.append({"name": f"host-{i}", "hostPath": {"path": host, "type": "Directory"}})
        mounts.append({"name": f"host-{i}", "mountPath": target, "readOnly": True})
    if volumes:
        pod_spec["volumes"] = volumes
        container["volumeMounts"] = mounts
    if opts.node_selector:
        pod_spec["nodeSelector"] = dict(opts.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if opts.image_pull_secret:
        pod_spec["imagePullSecrets"] = [{"name": opts.image_pull_secret}]

    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(spec)},
        "progressDeadlineSeconds": opts.progress_deadline_seconds,
        "revisionHistoryLimit": 5,
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": opts.max_surge, "maxUnavailable": opts.max_unavailable},
        },
        "template": {
            "metadata": {
                "labels": dict(all_labels),
                "annotations": {
                    **annotations,
                    **({STORE_SECRET_ANNOTATION: store_secret[1]} if store_secret and not opts.env_from_secret else {}),
                },
            },
            "spec": pod_spec,
        },
    }
    if opts.autoscale_max_replicas is None:
        deployment_spec["replicas"] = spec.replicas  # with an HPA, the HPA owns replicas
    meta = {"name": name, "namespace": opts.namespace, "labels": dict(all_labels)}
    out: dict[str, dict[str, Any]] = {
        "deployment": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "annotations": dict(annotations)},
            "spec": deployment_spec,
        },
        "service": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {**meta, "labels": {k: v for k, v in all_labels.items() if k != "app.kubernetes.io/version"}},
            "spec": {
                "type": opts.service_type,
                "selector": selector_labels(spec),
                # protocol is explicit: a 1.20 server cannot server-side apply a port without it.
                "ports": [{"name": PORT_NAME, "port": opts.service_port, "targetPort": PORT_NAME, "protocol": "TCP"}],
            },
        },
    }
    stable_meta = {**meta, "labels": out["service"]["metadata"]["labels"]}
    if opts.autoscale_max_replicas is not None:
        out["hpa"] = {
            "apiVersion": opts.hpa_api_version,
            "kind": "HorizontalPodAutoscaler",
            "metadata": stable_meta,
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": spec.replicas,
                "maxReplicas": opts.autoscale_max_replicas,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": opts.autoscale_cpu_percent},
                        },
                    }
                ],
            },
        }
    if opts.pdb_min_available is not None:
        out["pdb"] = {
            "apiVersion": opts.pdb_api_version,
            "kind": "PodDisruptionBudget",
            "metadata": stable_meta,
            "spec": {"minAvailable": opts.pdb_min_available, "selector": {"matchLabels": selector_labels(spec)}},
        }
    return out


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def candidate_object_name(name: str, kind: str) -> str:
    """The Deployment and Service name of the new version judged as ``kind`` (canary or shadow) of ``name``."""
    candidate = f"{name}-{kind}"
    if len(candidate) > 63:
        raise ConfigurationError(
            f"service name {name!r} leaves no room for its {kind}'s objects ({candidate!r} is longer than 63 "
            f"characters): use a service_name of at most {62 - len(kind)} characters"
        )
    return candidate


def candidate_manifests(objects: Mapping[str, dict[str, Any]], kind: str, replicas: int) -> dict[str, dict[str, Any]]:
    """The Deployment and Service of a new version judged as a ``kind`` (canary or shadow): the service's own
    (``objects``, as ``build_manifests`` made them for the new version) named ``<name>-<kind>``, selecting pods by
    their own labels plus ``TRACK_LABEL`` (never the service's: its Service does not send them requests, its
    pods do), ``replicas`` of them, no autoscaling, and no route file (a candidate sends nothing on)."""
    deployment, service = copy.deepcopy(objects["deployment"]), copy.deepcopy(objects["service"])
    name = deployment["metadata"]["name"]
    candidate = candidate_object_name(name, kind)
    own = selector_labels(candidate)

    def relabelled(labels: dict[str, str]) -> dict[str, str]:
        return {**labels, **own, TRACK_LABEL: kind}

    for obj in (deployment, service):
        obj["metadata"]["name"] = candidate
        obj["metadata"]["labels"] = relabelled(obj["metadata"]["labels"])
    spec = deployment["spec"]
    spec["selector"] = {"matchLabels": own}
    spec["replicas"] = replicas
    spec["template"]["metadata"]["labels"] = relabelled(spec["template"]["metadata"]["labels"])
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    container["env"] = [e for e in container.get("env", []) if e["name"] != contract.ROUTE_FILE]
    for holder, key in ((pod, "volumes"), (container, "volumeMounts")):
        kept = [v for v in holder.get(key, []) if v["name"] != "route"]
        if kept:
            holder[key] = kept
        else:
            holder.pop(key, None)
    service["spec"]["selector"] = dict(own)
    service["spec"]["type"] = "ClusterIP"  # reached by the service's pods only
    return {"deployment": deployment, "service": service}
