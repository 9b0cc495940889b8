"""The rolling update of a Kubernetes service, and the way back: the ``KubernetesRolling`` part of
``KubernetesCluster``.

``_roll_out`` server-side applies the Deployment (and its Service, HPA, PDB), watches the rollout
(``blocks/kubernetes/rollout.py``) until it is available, failed (ImagePullBackOff, CrashLoopBackOff, OOMKilled,
ProgressDeadlineExceeded, ...) or out of time, and sends the spec's smoke request to a ready pod of the new
ReplicaSet through the API server's pod proxy (``pod_request``: it needs no route to the pods). When either
fails it applies the previous ReplicaSet's pod template (what ``kubectl rollout undo`` does), waits until the
previous version is available again and raises ``RolledBack`` saying why and which version serves.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

from blocks.base.log import run_logger
from blocks.base.serving import Release, smoke_check
from blocks.errors import DeployFailed, RolledBack
from blocks.kubernetes import manifests, rollout
from blocks.kubernetes.api import NoAnswer
from blocks.records import Endpoint
from blocks.specs import ServingSpec

if TYPE_CHECKING:
    from blocks.kubernetes.api import KubeApi


class RollingCluster(Protocol):
    """What the rolling update needs of ``KubernetesCluster``."""

    namespace: str
    field_manager: str
    force_conflicts: bool
    container_port: int
    request_timeout_seconds: float

    def _api(self) -> KubeApi: ...

    def _url(self, name: str, spec: ServingSpec | None = None) -> str: ...

    @classmethod
    def get_block_type_slug(cls) -> str: ...


if TYPE_CHECKING:
    _Base = RollingCluster
else:
    _Base = object  # the type checker's view of the block; a plain mixin here


class KubernetesRolling(_Base):
    def _roll_out(
        self,
        spec: ServingSpec,
        release: Release,
        objects: dict[str, dict[str, Any]],
        before: dict[str, Any] | None,
        previous_version: str | None,
        timeout: float,
    ) -> Endpoint:
        """Apply the objects, watch the rollout, smoke-test a new pod; back to the previous revision when it
        fails (``RolledBack``)."""
        api, log = self._api(), run_logger("gpuferry.kubernetes")
        name = manifests.service_object_name(spec)
        after = api.server_side_apply(
            objects["deployment"], field_manager=self.field_manager, force=self.force_conflicts
        )
        for key in ("service", "hpa", "pdb"):
            if key in objects:
                api.server_side_apply(objects[key], field_manager=self.field_manager, force=self.force_conflicts)
        changed = before is None or after["metadata"]["generation"] != before["metadata"]["generation"]
        log.info(
            "%s/%s: applied v%s (%s)",
            self.namespace,
            name,
            release.version,
            f"generation {after['metadata']['generation']}" if changed else "no change",
        )

        state = self._watch(name, timeout)
        if state.phase == "done":
            endpoint = self._endpoint(spec, release.version, previous_version, changed=changed, state=state)
            if not changed:
                return endpoint  # the version that serves passed its smoke test when it was deployed
            try:
                pod = self._smoke_test(spec, release, state)
            except DeployFailed as exc:
                failure = f"v{release.version} of {self.namespace}/{name} failed its smoke test: {exc}"
                reason = "SmokeTestFailed"
            else:
                log.info("%s: smoke test passed on pod %s", name, pod)
                return endpoint
        else:
            failure = f"v{release.version} of {self.namespace}/{name} failed to roll out: {state.message}"
            reason = state.reason

        # The new version failed: back to the previous revision's pod template.
        current = api.read("apps/v1", "Deployment", name, namespace=self.namespace)
        replicasets = self._replicasets(name)
        previous_rs = rollout.previous_replicaset(current, replicasets)
        if previous_rs is None:
            raise DeployFailed(
                f"{failure}. There is no previous revision to roll back to; the Deployment is left as is "
                f"for inspection (kubectl -n {self.namespace} describe deployment {name})"
            )
        old_version = (
            previous_rs["spec"]["template"]["metadata"]
            .get("annotations", {})
            .get(manifests.MODEL_VERSION_ANNOTATION, "?")
        )
        log.warning("%s; rolling back to v%s (revision %s)", failure, old_version, rollout.revision_of(previous_rs))
        api.server_side_apply(
            _rollback_manifest(objects["deployment"], previous_rs),
            field_manager=self.field_manager,
            force=self.force_conflicts,
        )
        back = self._watch(name, timeout)
        if back.phase != "done":
            raise DeployFailed(f"{failure}. Rolling back to v{old_version} did not finish either: {back.message}")
        raise RolledBack(
            f"{failure}. Rolled back automatically: v{old_version} is available again "
            f"({back.available}/{back.desired} replicas)",
            failed_version=release.version,
            rolled_back_to=old_version,
            reason=reason,
        )

    def _endpoint(
        self,
        spec: ServingSpec,
        version: str,
        previous_version: str | None,
        *,
        changed: bool,
        state: rollout.RolloutState,
    ) -> Endpoint:
        """Where the rolled-out version serves, and how the rollout ended."""
        name = manifests.service_object_name(spec)
        return Endpoint(
            service=spec.service,
            url=self._url(name, spec),
            model_version=version,
            backend=self.get_block_type_slug(),
            previous_version=previous_version,
            detail={
                "changed": changed,
                "namespace": self.namespace,
                "deployment": name,
                "revision": state.revision,
                "available_replicas": state.available,
                "replicas": state.desired,
            },
        )

    def _watch(self, name: str, timeout: float) -> rollout.RolloutState:
        api, log = self._api(), run_logger("gpuferry.kubernetes")
        selector = manifests.label_selector(name)

        def fetch() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
            dep = api.read("apps/v1", "Deployment", name, namespace=self.namespace)
            rss = self._replicasets(name)
            pods = api.items("v1", "Pod", namespace=self.namespace, label_selector=selector)
            return dep, rss, pods

        return rollout.watch(fetch, timeout=timeout, on_change=lambda s: log.info("%s: %s", name, s.message))

    def _replicasets(self, name: str) -> list[dict[str, Any]]:
        selector = manifests.label_selector(name)
        return self._api().items("apps/v1", "ReplicaSet", namespace=self.namespace, label_selector=selector)

    def _smoke_test(self, spec: ServingSpec, release: Release, state: rollout.RolloutState) -> str:
        """The spec's smoke request on a ready pod of the new ReplicaSet; returns the pod's name."""
        ready = [p["name"] for p in state.pods if p["ready"]]
        if not ready:
            raise DeployFailed("no ready pod of the new ReplicaSet to send it to")
        server = release.server
        port = self.container_port if server.mlflow_server else server.port
        send = functools.partial(self.pod_request, ready[0], port=port)
        try:
            smoke_check(send, server, spec.smoke_request or {})
        except DeployFailed as exc:
            raise DeployFailed(f"pod {ready[0]}: {exc}") from None
        except NoAnswer as exc:
            raise DeployFailed(f"pod {ready[0]}: smoke test: no answer ({exc.cause})") from None
        return ready[0]

    def pod_request(
        self, pod: str, path: str, body: dict[str, Any] | None = None, port: int | None = None
    ) -> tuple[int, Any]:
        """``path`` of the server in ``pod`` (on ``port``, default container_port), through the API server's pod
        proxy: POST ``body`` as JSON, or GET when it is None. Returns the status code and the parsed body (JSON,
        else the text). The smoke test's transport; it reaches a pod wherever the caller runs, as kubectl does."""
        if not path.startswith("/"):
            raise ValueError(f"path={path!r} must start with '/'")
        proxied = f"/api/v1/namespaces/{self.namespace}/pods/{pod}:{port or self.container_port}/proxy{path}"
        return self._api().proxy(proxied, body, timeout=self.request_timeout_seconds)


def _rollback_manifest(desired: dict[str, Any], previous_rs: dict[str, Any]) -> dict[str, Any]:
    """The Deployment as applied, with the previous ReplicaSet's pod template (and its version's metadata)."""
    template = previous_rs["spec"]["template"]
    meta = dict(template.get("metadata", {}))
    meta["labels"] = {k: v for k, v in meta.get("labels", {}).items() if k != "pod-template-hash"}
    meta.pop("creationTimestamp", None)
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k.startswith(manifests.ANNOTATION_PREFIX)}
    out = {**desired, "metadata": dict(desired["metadata"]), "spec": dict(desired["spec"])}
    out["spec"]["template"] = {"metadata": meta, "spec": template["spec"]}
    out["metadata"]["annotations"] = {**desired["metadata"].get("annotations", {}), **annotations}
    out["metadata"]["labels"] = {**desired["metadata"]["labels"]}
    version = meta["labels"].get("app.kubernetes.io/version")
    if version:
        out["metadata"]["labels"]["app.kubernetes.io/version"] = version
    else:
        out["metadata"]["labels"].pop("app.kubernetes.io/version", None)
    return out
