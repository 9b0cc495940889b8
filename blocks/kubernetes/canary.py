"""A canary or a shadow on Kubernetes: the new version runs as a Deployment and Service of its own
(``<name>-canary`` or ``<name>-shadow``, ``manifests.candidate_manifests``) that the service's Service never
selects; the serving version's own pods send it a share of their requests (canary: its answers are the clients')
or a copy of them (shadow), told so by their route file (``runtime/route.py``), a key of the ConfigMap
``<name>-route`` mounted into every serving pod.

Why the serving pods route, not the Service: a Service balances connections, not requests (a keep-alive client
stays on one pod), and a share set by a ratio of replicas costs GPUs (10 % needs nine serving replicas per canary
replica). Routed by the pods, the share is exact per request whatever the clients do, the canary needs one
replica per ``share`` of the serving ones (at least one), and no service mesh is needed. A canary request that
gets no answer (the canary removed, not ready) is answered by the serving pod itself: removing a canary costs no
client a failed request.

The kubelet refreshes a mounted ConfigMap on its own schedule (about a minute); a change to the pod refreshes it
at once, so each ready serving pod is annotated with the route's generation, and the window starts only once
every one of them reports that generation on its ``/metrics``. Both versions' ``/metrics`` are read through the
API server's pod proxy, as the smoke test reaches pods. The window's state and a decision taken by hand
(``gpuferry rollout``) are annotations on the candidate's Deployment.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

from blocks.base.analysis import CandidateGone, Sample, decided, run_window
from blocks.base.backoff import Poll
from blocks.base.log import run_logger
from blocks.base.serving import Release
from blocks.errors import CanaryFailed, ConfigurationError, DeployFailed
from blocks.kubernetes import manifests
from blocks.kubernetes.api import NoAnswer
from blocks.specs import ServingSpec
from runtime import contract

if TYPE_CHECKING:
    from blocks.kubernetes.api import KubeApi
    from blocks.kubernetes.rollout import RolloutState

STATE_ANNOTATION = manifests.ANNOTATION_PREFIX + "rollout-state"
DECISION_ANNOTATION = manifests.ANNOTATION_PREFIX + "rollout-decision"
ROUTE_GENERATION_ANNOTATION = manifests.ANNOTATION_PREFIX + "route-generation"
ROUTE_WAIT_S = 120.0  # how long every serving pod may take to apply a route
KINDS = ("canary", "shadow")
_MERGE = "application/merge-patch+json"


class CanaryCluster(Protocol):
    """What the canary needs of ``KubernetesCluster``."""

    namespace: str
    field_manager: str
    force_conflicts: bool
    service_port: int
    progress_deadline_seconds: int

    def _api(self) -> KubeApi: ...

    def _watch(self, name: str, timeout: float) -> RolloutState: ...

    def _smoke_test(self, spec: ServingSpec, release: Release, state: RolloutState) -> str: ...

    def pod_request(
        self, pod: str, path: str, body: dict[str, Any] | None = None, port: int | None = None
    ) -> tuple[int, Any]: ...


if TYPE_CHECKING:
    _Base = CanaryCluster
else:
    _Base = object  # the type checker's view of the block; a plain mixin here


def _live(pods: list[dict[str, Any]]) -> list[str]:
    """The names of the pods that are ready and not on their way out."""
    return [
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
    ]


class KubernetesCanary(_Base):
    def _judge(
        self,
        spec: ServingSpec,
        release: Release,
        objects: dict[str, dict[str, Any]],
        serving: dict[str, Any],
        timeout: float,
    ) -> dict[str, Any]:
        """Run the new version (``objects``) as a canary or shadow of the ``serving`` Deployment for the window of
        ``spec.rollout``. Passed: what was measured (the route already off, ``decision_s`` measured); the caller
        rolls the service out and then calls ``_remove_candidates``. Failed: ``CanaryFailed``, the candidate
        removed and the serving version answering every request."""
        policy = spec.rollout
        assert policy is not None and policy.strategy in KINDS
        kind = policy.strategy
        log = run_logger("gpuferry.kubernetes.canary")
        name = serving["metadata"]["name"]
        old_version = serving["metadata"].get("annotations", {}).get(manifests.MODEL_VERSION_ANNOTATION, "?")
        env = serving["spec"]["template"]["spec"]["containers"][0].get("env", [])
        if not any(e.get("name") == contract.ROUTE_FILE for e in env):
            raise DeployFailed(
                f"v{old_version} of {self.namespace}/{name} runs pods without a route file (deployed by an older "
                f"gpuferry, or by another server), so no {kind} can be given a share of its requests: deploy once "
                f"with serve.rollout.strategy 'rolling', then roll out by {kind}"
            )
        api = self._api()
        replicas = max(1, math.ceil(policy.share * (serving["spec"].get("replicas") or 1)))
        candidate = manifests.candidate_manifests(objects, kind, replicas)
        cname = candidate["deployment"]["metadata"]["name"]
        version = release.version
        log.info("%s/%s: v%s starts as the %s (replicas: %d)", self.namespace, name, version, kind, replicas)
        try:
            for obj in candidate.values():
                api.server_side_apply(obj, field_manager=self.field_manager, force=self.force_conflicts)
            state = self._watch(cname, timeout)
            if state.phase != "done":
                raise DeployFailed(f"its {kind} did not start: {state.message}")
            self._smoke_test(spec, release, state)
            address = api.read("v1", "Service", cname, namespace=self.namespace)["spec"]["clusterIP"]
            url = f"http://{address}:{self.service_port}/invocations"  # by address: no cluster DNS needed
            route: dict[str, Any] = {"url": url, "share": policy.share}
            if kind == "shadow":
                route.update(rtol=policy.rtol, atol=policy.atol)
            if not self._set_route(name, {kind: route}):
                raise DeployFailed(
                    f"the serving pods did not take the {kind}'s route within {ROUTE_WAIT_S:.0f} s (see their "
                    f"log: kubectl -n {self.namespace} logs -l {manifests.label_selector(name)})"
                )
            log.info(
                "v%s of %s %s %g of the requests for %g s",
                version,
                name,
                "answers" if kind == "canary" else "gets a copy of",
                policy.share,
                policy.window_seconds,
            )
            numbers, reasons = run_window(
                policy,
                service=spec.service,
                version=version,
                serving_version=old_version,
                current=lambda: self._sample(name, f"v{old_version} (serving)"),
                candidate=lambda: self._candidate_sample(cname, f"v{version} (the {kind})"),
                publish=lambda s: self._annotate("apps/v1", "Deployment", cname, {STATE_ANNOTATION: _dumps(s)}),
                decision=lambda: _annotations(self._candidate(cname)).get(DECISION_ANNOTATION),
                log=log,
            )
        except BaseException as exc:
            try:
                self._set_route(name, None)
                self._remove_candidates(name)
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to report; this one is logged
                log.warning("%s: could not end the %s (%s); the next deploy ends it", name, kind, cleanup)
            if isinstance(exc, DeployFailed) and not isinstance(exc, CanaryFailed):
                raise DeployFailed(
                    f"v{version} of {self.namespace}/{name} was removed, v{old_version} serves every request: {exc}"
                ) from exc
            raise
        if not self._set_route(name, None):  # a pod that is slow to take it still answers: its canary stays up
            log.warning("%s: not every serving pod confirmed the end of the %s's route", name, kind)
        decided(numbers)  # the serving pods send it nothing more: the verdict is applied
        if not reasons:
            return numbers
        self._remove_candidates(name)
        raise CanaryFailed(
            f"v{version} of {spec.service} failed its {kind} and was removed, v{old_version} serves every "
            "request: " + "; ".join(reasons),
            version=version,
            serving_version=old_version,
            reasons=reasons,
            numbers=numbers,
        )

    # ---- the route ---------------------------------------------------------------------------

    def _set_route(self, name: str, route: dict[str, Any] | None) -> bool:
        """Write the service's route (None: none) and wait until every ready serving pod applies it; False when
        one did not within ``ROUTE_WAIT_S``."""
        api = self._api()
        generation = time.time_ns() // 1_000_000  # grows from one deploy to the next
        config = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": manifests.route_config_name(name),
                "namespace": self.namespace,
                "labels": {**manifests.selector_labels(name), "app.kubernetes.io/managed-by": manifests.MANAGED_BY},
            },
            "data": {manifests.ROUTE_KEY: json.dumps({"generation": generation, **(route or {})})},
        }
        api.server_side_apply(config, field_manager=self.field_manager, force=True)  # ours alone
        pending = set(self._serving_pods(name))
        for pod in pending:  # a change to the pod makes its kubelet refresh the ConfigMap now
            self._annotate("v1", "Pod", pod, {ROUTE_GENERATION_ANNOTATION: str(generation)})
        poll = Poll(0.2, 2.0, timeout=ROUTE_WAIT_S)
        while pending:
            live = set(self._serving_pods(name))
            for pod in sorted(pending):
                if pod not in live or _gauge(self._metrics(pod), "inference_route_generation") >= generation:
                    pending.discard(pod)
            if pending and poll.expired():
                return False
            if pending:
                poll.wait()
        return True

    def _serving_pods(self, name: str) -> list[str]:
        pods = self._api().items("v1", "Pod", namespace=self.namespace, label_selector=manifests.label_selector(name))
        return _live(pods)

    def _metrics(self, pod: str, what: str = "") -> str:
        """The pod's ``/metrics`` text; ``DeployFailed`` naming ``what`` (the pod) when it does not answer."""
        try:
            status, text = self.pod_request(pod, "/metrics")
        except NoAnswer as exc:
            raise DeployFailed(f"{what or 'pod'} {pod} did not answer /metrics ({exc.cause})") from None
        if status != 200:
            raise DeployFailed(f"{what or 'pod'} {pod} answered /metrics with {status}")
        return str(text)

    def _sample(self, name: str, what: str) -> Sample:
        """The counters of every ready pod of the Deployment ``name``, added."""
        total = Sample()
        for pod in self._serving_pods(name):
            total = total + Sample.parse(self._metrics(pod, what))
        return total

    def _candidate_sample(self, candidate: str, what: str) -> Sample:
        """The candidate's counters; ``CandidateGone`` when its pods do not answer."""
        try:
            return self._sample(candidate, what)
        except DeployFailed as exc:
            raise CandidateGone(str(exc)) from None

    # ---- the candidate's objects ---------------------------------------------------------------

    def _candidate(self, candidate: str) -> dict[str, Any] | None:
        return self._api().read_or_none("apps/v1", "Deployment", candidate, namespace=self.namespace)

    def _annotate(self, api_version: str, kind: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge ``annotations`` into the object's (None: remove the key)."""
        plural = {"Deployment": "deployments", "Pod": "pods"}[kind]
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        path = f"{prefix}/namespaces/{self.namespace}/{plural}/{name}"
        self._api().request("PATCH", path, body={"metadata": {"annotations": annotations}}, content_type=_MERGE)

    def _remove_candidates(self, name: str) -> None:
        """The canary's or shadow's Deployment (once its pods are gone: they drain first) and Service."""
        api = self._api()
        for kind in KINDS:
            candidate = f"{name}-{kind}"
            gone = api.remove(
                "apps/v1", "Deployment", candidate, namespace=self.namespace, propagation_policy="Foreground"
            )
            api.remove("v1", "Service", candidate, namespace=self.namespace)
            poll = Poll(0.2, 2.0, timeout=self.progress_deadline_seconds)
            while gone and self._candidate(candidate) is not None and not poll.expired():
                poll.wait()

    def _end_stale_window(self, name: str) -> None:
        """A window a deploy left under way (its process killed): the serving pods route nothing, the candidate
        goes."""
        found = [c for kind in KINDS if (c := self._candidate(f"{name}-{kind}")) is not None]
        config = self._api().read_or_none(
            "v1", "ConfigMap", manifests.route_config_name(name), namespace=self.namespace
        )
        routed = set(json.loads((config or {}).get("data", {}).get(manifests.ROUTE_KEY, "{}"))) & set(KINDS)
        if not found and not routed:
            return
        stale = json.loads(_annotations(found[0]).get(STATE_ANNOTATION) or "{}") if found else {}
        run_logger("gpuferry.kubernetes.canary").warning(
            "%s/%s: ending the %s of v%s that a deploy left under way",
            self.namespace,
            name,
            stale.get("strategy", "canary or shadow"),
            stale.get("version", "?"),
        )
        self._set_route(name, None)
        self._remove_candidates(name)

    # ---- by hand -------------------------------------------------------------------------------

    def rollout_status(self, service: str) -> dict[str, Any] | None:
        """The canary or shadow window under way for ``service`` (what its deploy last published), or None."""
        name = manifests.service_object_name(ServingSpec(service_name=service))
        for kind in KINDS:
            state = _annotations(self._candidate(f"{name}-{kind}")).get(STATE_ANNOTATION)
            if state:
                return dict(json.loads(state))
        return None

    def decide_rollout(self, service: str, decision: str) -> None:
        """End the window under way now: ``promote`` (it passes) or ``abort`` (it fails and is removed)."""
        name = manifests.service_object_name(ServingSpec(service_name=service))
        for kind in KINDS:
            if _annotations(self._candidate(f"{name}-{kind}")).get(STATE_ANNOTATION):
                self._annotate("apps/v1", "Deployment", f"{name}-{kind}", {DECISION_ANNOTATION: decision})
                return
        raise ConfigurationError(f"no canary or shadow window is under way for {service!r}")


def _annotations(obj: dict[str, Any] | None) -> dict[str, str]:
    return dict((obj or {}).get("metadata", {}).get("annotations") or {})


def _dumps(state: dict[str, Any] | None) -> str | None:
    return json.dumps(state) if state else None


def _gauge(text: str, name: str) -> float:
    """The value of the unlabelled series ``name`` in a ``/metrics`` text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return 0.0
    return 0.0
