"""Serving on Kubernetes: the ``KubernetesCluster`` block.

``deploy(spec, release)``:

1. checks everything it can without the cluster (``validate``, an image pinned by digest);
2. preflight against the cluster, before anything is applied: the namespace exists and some node
   offers the GPU resource a replica asks for (``nvidia.com/gpu``, a MIG slice such as
   ``nvidia.com/mig-1g.10gb``, or a time-sliced resource name);
3. puts the store's credentials (``Release.store_env``) and its CA certificate into a Secret of the service's
   own (``<service>-model-store``, ``blocks/kubernetes/secrets.py``; the pods read it through ``envFrom``, or key by
   key with the certificate as a read-only file when there is one) unless
   ``env_from_secret`` names the user's; then server-side applies the Deployment, the Service and, when
   configured, an HPA and a PodDisruptionBudget in the API versions the server serves (discovery), as our
   own field manager —
   a field owned by another manager is a clear error, not a silent overwrite;
4. with a canary or shadow policy and a version already serving, runs the new one beside it for the
   analysis window first (``blocks/kubernetes/canary.py``); it goes on only when the new version passed;
5. watches the rollout until it is available, failed or out of time, sends the spec's smoke request to a ready
   pod of the new ReplicaSet and, on failure of either, rolls back to the previous ReplicaSet's pod template
   (``blocks/kubernetes/rolling.py``), raising ``RolledBack`` saying why and which version serves.

Deploying the version that already serves changes nothing (the apply is a no-op; the generation stays;
no smoke test).
Modules: ``api`` (the official client's ``DynamicClient``, retries, errors), ``manifests`` (pure spec →
objects), ``rollout`` (rollout state and watch), ``rolling`` (apply, watch, smoke test, roll back), ``canary``
(canary and shadow windows), ``secrets`` (the store's Secret), ``check`` (``self_check``).
"""

from __future__ import annotations

import re
import threading
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, SecretStr

from blocks.base.backoff import Poll
from blocks.base.serving import Release, ServingBackend, require_smoke_request
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, DeployFailed
from blocks.kubernetes import manifests, rollout
from blocks.kubernetes import secrets as k8s_secrets
from blocks.kubernetes.api import Connection, KubeApi, connection_from_kubeconfig, connection_in_cluster
from blocks.kubernetes.canary import KubernetesCanary
from blocks.kubernetes.rolling import KubernetesRolling
from blocks.records import Endpoint
from blocks.specs import MIG_PROFILES, ServingSpec

_API_VERSION_PREFERENCE = {
    "autoscaling": ("v2", "v2beta2"),
    "policy": ("v1", "v1beta1"),
}


class KubernetesCluster(KubernetesRolling, KubernetesCanary, ServingBackend):
    """Serves the model as a Deployment + Service on a Kubernetes cluster."""

    needs_image: ClassVar[bool] = True
    rollout_strategies: ClassVar[tuple[str, ...]] = ("rolling", "canary", "shadow")

    _block_type_name = "gpuferry Kubernetes Cluster"
    _description = (
        "Serves the model on Kubernetes: Deployment (GPU, MIG or time-sliced resources) + Service, server-side "
        "apply, rollout watch and automatic rollback."
    )

    # ---- connection
    kubeconfig: SecretStr | None = Field(
        None, description="kubeconfig file content (YAML). Empty: in-cluster (the pod's service account)."
    )
    context: str | None = Field(None, description="kubeconfig context (None: its current-context).")
    namespace: str = Field("default", description="Namespace of the service's objects; it must exist.")
    field_manager: str = Field("gpuferry", description="Field manager name of our server-side applies.")
    force_conflicts: bool = Field(
        False, description="Take over fields another field manager owns (server-side apply force). Off: a clear error."
    )
    request_timeout_seconds: float = Field(30.0, gt=0, description="Seconds one API request may take.")
    api_retries: int = Field(4, ge=0, le=20, description="Retries of one API request after a 5xx, 429 or timeout.")
    # ---- the workload's objects
    container_port: int = Field(
        8080,
        ge=1,
        le=65535,
        description="Port gpuferry's model server listens on in the pod (a workload's own server: its serve.port).",
    )
    service_port: int = Field(80, ge=1, le=65535, description="Port of the Service.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    service_url: str | None = Field(
        None, description="URL clients use (an Ingress, a LoadBalancer address). None: the Service's cluster DNS name."
    )
    gpu_resource: str = Field(
        "nvidia.com/gpu",
        description="Resource name of whole GPUs; a time-sliced GPU's renamed resource (e.g. nvidia.com/gpu.shared).",
    )
    mig_resource_prefix: str = Field(
        "nvidia.com/mig-", description="Prefix of MIG resources (device plugin 'mixed' strategy): + the MIG profile."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels a serving pod requires.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Pod tolerations (one for the GPU resource's taint is added by itself)."
    )
    cpu_request: str | None = Field("250m", description="CPU request per replica.")
    memory_request: str | None = Field("512Mi", description="Memory request per replica.")
    cpu_limit: str | None = Field(None, description="CPU limit per replica (None: none).")
    memory_limit: str | None = Field("2Gi", description="Memory limit per replica (a server above it is OOMKilled).")
    command: list[str] | None = Field(
        None,
        description="Container command over the workload's (None: gpuferry's model server, or the workload's serve.command).",  # noqa: E501 - part of the saved schema
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables of the server (not secrets); they win over the Secret's "
        "(e.g. AWS_ENDPOINT_URL: the store's endpoint as the pods reach it).",
    )
    env_from_secret: str | None = Field(
        None,
        description="Name of a Secret of yours whose keys become the server's environment variables. None: gpuferry "
        "puts the checkpoint store's credentials into a Secret of the service's own (<service>-model-store).",
    )
    image_pull_secret: str | None = Field(None, description="Name of the Secret used to pull the image.")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="When the node pulls the image (it is pinned by digest: IfNotPresent is safe)."
    )
    max_surge: str | int = Field("25%", description="Rolling update: extra replicas while the new version starts.")
    max_unavailable: str | int = Field(
        0, description="Rolling update: replicas that may be unavailable (0: the old version serves until replaced)."
    )
    termination_grace_seconds: int = Field(
        30, ge=0, description="How long a replica may drain after SIGTERM before it is killed."
    )
    host_path_mounts: dict[str, str] = Field(
        default_factory=dict, description="Node directories mounted read-only into the pod, node path → pod path."
    )
    progress_deadline_seconds: int = Field(
        600, ge=10, description="Deployment progressDeadlineSeconds: no progress for this long fails the rollout."
    )
    rollout_timeout_seconds: float | None = Field(
        None, gt=0, description="How long we watch a rollout (None: the spec's ready_timeout_seconds + 60)."
    )
    autoscale_max_replicas: int | None = Field(
        None, ge=1, description="Create an HPA from the spec's replicas up to this many (None: no HPA)."
    )
    autoscale_cpu_percent: int = Field(80, ge=1, le=100, description="HPA target CPU utilization.")
    pdb_min_available: int | str | None = Field(
        None, description="Create a PodDisruptionBudget with this minAvailable (a count or a percentage)."
    )

    _lock: Any = PrivateAttr(default_factory=threading.RLock)
    _api_client: KubeApi | None = PrivateAttr(None)
    _api_for: tuple[Any, ...] | None = PrivateAttr(None)
    _discovered: dict[str, str | bool] | None = PrivateAttr(None)

    # ---- connection ------------------------------------------------------------------------

    def _api(self) -> KubeApi:
        key = (
            self.kubeconfig.get_secret_value() if self.kubeconfig else None,
            self.context,
            self.request_timeout_seconds,
            self.api_retries,
        )
        with self._lock:
            if self._api_client is None or self._api_for != key:
                conn: Connection = (
                    connection_from_kubeconfig(key[0], self.context) if key[0] else connection_in_cluster()
                )
                if self._api_client is not None:
                    self._api_client.close()
                self._api_client = KubeApi(conn, timeout=self.request_timeout_seconds, retries=self.api_retries)
                self._api_for = key
                self._discovered = None
            return self._api_client

    def _options(self, **overrides: Any) -> manifests.ManifestOptions:
        fields = {
            name: getattr(self, name)
            for name in manifests.ManifestOptions.model_fields
            if name in type(self).model_fields
        }
        return manifests.options(**{**fields, **overrides})

    # ---- ServingBackend ----------------------------------------------------------------------

    def validate(self, spec: ServingSpec) -> None:  # type: ignore[override]  # pydantic v1's BaseModel.validate, unused
        """Everything checkable without the cluster: names, quantities, MIG profile, HPA bounds."""
        if spec.mig_profile is not None and spec.mig_profile not in MIG_PROFILES:
            raise ConfigurationError(
                f"mig_profile={spec.mig_profile!r} is not a MIG profile; use one of: {', '.join(MIG_PROFILES)}"
            )
        if spec.mig_profile and spec.gpus:
            raise ConfigurationError("set either gpus or mig_profile, not both")
        if spec.gpu_devices:
            raise ConfigurationError(
                f"gpu_devices={spec.gpu_devices}: Kubernetes' device plugin chooses a pod's GPUs; "
                "ask for a count (gpus), or use a Docker stack to name GPUs"
            )
        manifests.service_object_name(spec)
        opts = manifests.with_shape(self._options(), spec)
        if opts.autoscale_max_replicas is not None and opts.autoscale_max_replicas < spec.replicas:
            raise ConfigurationError(
                f"autoscale_max_replicas={opts.autoscale_max_replicas} is below replicas={spec.replicas}"
            )
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$", self.field_manager):
            raise ConfigurationError(
                f"field_manager={self.field_manager!r}: use 1-128 letters, digits, '.', '_', ':' or '-'"
            )

    def preflight(self, spec: ServingSpec) -> None:
        """Read-only checks against the cluster: the namespace exists, the HPA/PDB API versions the block
        needs are served, a schedulable node offers the GPU resource. Retrain and sweep run it before they
        acquire nodes; ``deploy`` runs it again before it applies anything."""
        self.validate(spec)
        api = self._api()
        if api.read_or_none("v1", "Namespace", self.namespace) is None:
            raise ConfigurationError(
                f"namespace={self.namespace!r} does not exist in the cluster: create it "
                f"(kubectl create namespace {self.namespace}) or set the block's namespace"
            )
        self._discover_versions(spec)
        request = manifests.gpu_request(spec, self._options())
        if request is None:
            return
        resource, count = request
        nodes = api.items("v1", "Node")
        offered: list[str] = []
        for node in nodes:
            labels = node.get("metadata", {}).get("labels", {})
            allocatable = node.get("status", {}).get("allocatable", {})
            gpuish = {k: v for k, v in allocatable.items() if k.startswith(("nvidia.com/", "amd.com/", "gpu"))}
            if gpuish:
                offered.append(
                    f"{node['metadata']['name']}: " + ", ".join(f"{k}={v}" for k, v in sorted(gpuish.items()))
                )
            if node.get("spec", {}).get("unschedulable"):
                continue
            if any(labels.get(k) != v for k, v in self.node_selector.items()):
                continue
            if _count(allocatable.get(resource, "0")) >= count:
                return
        want = f"mig_profile={spec.mig_profile!r}" if spec.mig_profile else f"gpus={spec.gpus}"
        raise ConfigurationError(
            f"no schedulable node{' matching node_selector ' + str(self.node_selector) if self.node_selector else ''} "
            f"offers {count} × {resource} ({want}); nodes with accelerators: {'; '.join(offered) or 'none'}. "
            "Ask for a resource a node offers (gpus, mig_profile, or the block's gpu_resource for time-sliced GPUs), "
            "or add such a node (NVIDIA device plugin; MIG strategy 'mixed' for MIG resources)"
        )

    def deploy(self, spec: ServingSpec, release: Release) -> Endpoint:
        self.validate(spec)
        image = release.image.reference if release.image else None
        manifests.check_image(image)
        require_smoke_request(spec)
        self.preflight(spec)
        api = self._api()
        opts = self._options(**self._discover_versions(spec))
        wanted = None if self.env_from_secret else k8s_secrets.store_secret_for(spec, release.store_env, opts)
        objects = manifests.build_manifests(
            spec,
            model_name=release.model_name,
            version=release.version,
            model_uri=release.model_uri,
            image=image,
            opts=opts,
            server=release.server,
            checkpoint_sha256=release.checkpoint_sha256,
            store_secret=k8s_secrets.put_store_secret(api, wanted),
            store_keys=sorted(wanted["data"]) if wanted else (),
        )
        name = manifests.service_object_name(spec)
        self._end_stale_window(name)
        before = self._deployment(name)
        previous_version = _annotation(before, manifests.MODEL_VERSION_ANNOTATION) if before else None
        timeout = self.rollout_timeout_seconds or spec.ready_timeout_seconds + 60
        policy, judged = spec.rollout, {}
        if policy and policy.strategy != "rolling" and before is not None and previous_version != release.version:
            judged = self._judge(spec, release, objects, before, timeout)  # CanaryFailed: it did not pass
        try:
            endpoint = self._roll_out(spec, release, objects, before, previous_version, timeout)
        finally:
            if judged:
                self._remove_candidates(name)  # the new version serves, or the old one again: the candidate goes
        if judged:
            endpoint.detail["rollout"] = judged
        return endpoint

    def services(self) -> list[str]:
        """The Deployments gpuferry made in the namespace (its managed-by label), by name."""
        selector = f"app.kubernetes.io/managed-by={manifests.MANAGED_BY},!{manifests.TRACK_LABEL}"  # no candidates
        found = self._api().items("apps/v1", "Deployment", namespace=self.namespace, label_selector=selector)
        return sorted(d["metadata"]["name"] for d in found)

    def current(self, service: str) -> dict[str, Any] | None:
        spec = ServingSpec(service_name=service)
        name = manifests.service_object_name(spec)
        dep = self._deployment(name)
        if dep is None:
            return None
        status = dep.get("status", {})
        return {
            "version": _annotation(dep, manifests.MODEL_VERSION_ANNOTATION),
            "model_uri": _annotation(dep, manifests.MODEL_URI_ANNOTATION),
            "model_name": _annotation(dep, manifests.MODEL_NAME_ANNOTATION),
            "url": self._url(name),
            "revision": _annotation(dep, rollout.REVISION_ANNOTATION),
            "generation": dep["metadata"].get("generation"),
            "replicas": dep.get("spec", {}).get("replicas"),
            "available_replicas": status.get("availableReplicas", 0),
            "image": dep["spec"]["template"]["spec"]["containers"][0].get("image"),
        }

    def undeploy(self, service: str) -> bool:
        name = manifests.service_object_name(ServingSpec(service_name=service))
        api = self._api()
        versions = self._discover_versions()
        served = self._discovered or {}
        for key, kind in (("hpa_api_version", "HorizontalPodAutoscaler"), ("pdb_api_version", "PodDisruptionBudget")):
            if served[f"_{key}_served"]:  # an API the server does not serve holds nothing of ours
                api.remove(versions[key], kind, name, namespace=self.namespace)
        self._remove_candidates(name)
        api.remove("v1", "ConfigMap", manifests.route_config_name(name), namespace=self.namespace)
        api.remove("v1", "Service", name, namespace=self.namespace)
        if self.env_from_secret is None:
            k8s_secrets.delete_store_secret(api, self.namespace, name + manifests.STORE_SECRET_SUFFIX)
        existed = api.remove("apps/v1", "Deployment", name, namespace=self.namespace, propagation_policy="Foreground")
        # Foreground: the Deployment goes once its pods are gone, so "stopped" means stopped.
        poll = Poll(0.2, 2.0, timeout=self.progress_deadline_seconds)
        while existed and self._deployment(name) is not None:
            if poll.expired():
                raise DeployFailed(
                    f"{self.namespace}/{name} was deleted but its pods did not stop within "
                    f"{self.progress_deadline_seconds} s (kubectl -n {self.namespace} get pods)"
                )
            poll.wait()
        return existed

    # ---- helpers -----------------------------------------------------------------------------

    def _discover_versions(self, spec: ServingSpec | None = None) -> dict[str, str]:
        """The HPA and PDB API versions this server serves (newest we know first); an error when the service
        (``spec``'s shape, or the block) autoscales or asks for a PDB and the server serves no version of it."""
        with self._lock:
            if self._discovered is None:
                api = self._api()
                found: dict[str, str | bool] = {}
                for group, key in (("autoscaling", "hpa_api_version"), ("policy", "pdb_api_version")):
                    served = api.served_versions(group)
                    version = next((v for v in _API_VERSION_PREFERENCE[group] if v in served), None)
                    found[key] = f"{group}/{version or _API_VERSION_PREFERENCE[group][0]}"
                    found[f"_{key}_served"] = bool(version)
                self._discovered = found
            needed = {
                "hpa_api_version": (
                    spec.max_replicas
                    if spec is not None and spec.max_replicas is not None
                    else self.autoscale_max_replicas
                )
                is not None,
                "pdb_api_version": self.pdb_min_available is not None,
            }
            for key, wanted in needed.items():
                if wanted and not self._discovered[f"_{key}_served"]:
                    group, field = (
                        ("autoscaling", "autoscale_max_replicas")
                        if key == "hpa_api_version"
                        else ("policy", "pdb_min_available")
                    )
                    versions = ", ".join(f"{group}/{v}" for v in _API_VERSION_PREFERENCE[group])
                    raise ConfigurationError(
                        f"the cluster serves none of {versions}, which {field} needs; unset {field}"
                    )
            return {k: str(v) for k, v in self._discovered.items() if not k.startswith("_")}

    def _deployment(self, name: str) -> dict[str, Any] | None:
        return self._api().read_or_none("apps/v1", "Deployment", name, namespace=self.namespace)

    def _url(self, name: str, spec: ServingSpec | None = None) -> str:
        """Where clients reach the service: its own URL (the shape's), else the stack's, else its cluster name."""
        return (
            (spec.url if spec is not None else None)
            or self.service_url
            or f"http://{name}.{self.namespace}.svc.cluster.local:{self.service_port}"
        )

    # ---- checks ------------------------------------------------------------------------------

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """Reach, namespace, the RBAC permissions a deploy needs, the pods' Secrets and the GPU/MIG nodes
        (``blocks/kubernetes/check.py``)."""
        from blocks.kubernetes.check import check_kubernetes

        check_kubernetes(self, probe)
        return probe.rows


def _annotation(obj: dict[str, Any] | None, key: str) -> str | None:
    return (obj or {}).get("metadata", {}).get("annotations", {}).get(key)


def _count(quantity: str | int) -> int:
    try:
        return int(quantity)
    except (TypeError, ValueError):
        return 0
