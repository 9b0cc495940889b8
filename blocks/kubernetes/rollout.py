"""Watching a Deployment's rollout: what state it is in, and why it failed.

``assess(deployment, replicasets, pods)`` is pure: it reads the objects as the API returns them and
says whether the rollout is done, still progressing, or failed — and for a failure, an actionable
sentence (the pod reasons ImagePullBackOff, CrashLoopBackOff, OOMKilled, ... turned into what to do).
``watch(...)`` polls with an interval that starts fast, until done, failed or the deadline.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from blocks.base.backoff import Poll

REVISION_ANNOTATION = "deployment.kubernetes.io/revision"

# Waiting reasons that do not heal by waiting: the kubelet already retried and backs off.
_FATAL_WAITING = {
    "ImagePullBackOff": "the node cannot pull image {image}: check that it exists in the registry (by digest) "
    "and that the cluster may pull it (image_pull_secret)",
    "InvalidImageName": "image {image} is not a valid image reference",
    "ErrImageNeverPull": "image {image} is not on the node and image_pull_policy is Never",
    "CrashLoopBackOff": "the server keeps exiting right after it starts{exit}: see its log "
    "(kubectl logs -n {namespace} {pod} --previous)",
    "CreateContainerConfigError": "the container cannot be created: {message} (a Secret or ConfigMap it "
    "references is missing?)",
    "CreateContainerError": "the container cannot be created: {message}",
    "RunContainerError": "the container cannot start: {message}",
}


@dataclass(frozen=True)
class RolloutState:
    phase: Literal["progressing", "done", "failed"]
    message: str
    reason: str = ""
    revision: str | None = None
    updated: int = 0
    available: int = 0
    desired: int = 0
    pods: list[dict[str, Any]] = field(default_factory=list)


def revision_of(obj: dict[str, Any]) -> int:
    try:
        return int(obj.get("metadata", {}).get("annotations", {}).get(REVISION_ANNOTATION, "0"))
    except ValueError:
        return 0


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    uid = owner.get("metadata", {}).get("uid")
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))


def current_replicaset(deployment: dict[str, Any], replicasets: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ReplicaSet of the Deployment's current revision (the one the rollout moves to)."""
    mine = [rs for rs in replicasets if owned_by(rs, deployment)]
    revision = revision_of(deployment)
    for rs in mine:
        if revision and revision_of(rs) == revision:
            return rs
    return max(mine, key=revision_of, default=None)


def previous_replicaset(deployment: dict[str, Any], replicasets: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest ReplicaSet older than the current one: the revision a rollback returns to."""
    current = current_replicaset(deployment, replicasets)
    if current is None:
        return None
    older = [rs for rs in replicasets if owned_by(rs, deployment) and revision_of(rs) < revision_of(current)]
    return max(older, key=revision_of, default=None)


def pod_problem(pod: dict[str, Any], namespace: str) -> tuple[str, str] | None:
    """(reason, actionable message) when the pod is in a state that waiting does not fix."""
    name = pod.get("metadata", {}).get("name", "?")
    for status in pod.get("status", {}).get("containerStatuses", []) or []:
        image = status.get("image", "?")
        for state_key in ("state", "lastState"):
            terminated = (status.get(state_key) or {}).get("terminated") or {}
            if terminated.get("reason") == "OOMKilled":
                return "OOMKilled", (
                    f"pod {name}: the server was killed for using more memory than its limit: raise memory_limit "
                    "on the KubernetesCluster block (or lower max_batch_size)"
                )
        waiting = (status.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in _FATAL_WAITING:
            last = (status.get("lastState") or {}).get("terminated") or {}
            exit_text = f" (exit code {last['exitCode']})" if "exitCode" in last else ""
            text = _FATAL_WAITING[reason].format(
                image=image, exit=exit_text, namespace=namespace, pod=name, message=waiting.get("message", "")
            )
            return reason, f"pod {name}: {reason}: {text}"
    return None


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return cond
    return {}


def _stale_deadline(progressing: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """Whether a ProgressDeadlineExceeded condition is about another ReplicaSet than the current one.

    After a rollback to an older ReplicaSet, the controller keeps the failed rollout's condition (it changes a
    condition only when its reason changes) until it sees progress: for a few seconds the Deployment says
    "ReplicaSet <the failed one> has timed out progressing" while it scales the old one back. That condition
    is not about this rollout; a deadline this rollout exceeds names its own ReplicaSet.
    """
    named = re.search(r'ReplicaSet "([^"]+)"', progressing.get("message", ""))
    current_name = (current or {}).get("metadata", {}).get("name")
    return bool(named and current_name and named.group(1) != current_name)


def assess(deployment: dict[str, Any], replicasets: list[dict[str, Any]], pods: list[dict[str, Any]]) -> RolloutState:
    """Where the rollout of ``deployment`` stands (the logic of ``kubectl rollout status``, plus pod reasons)."""
    meta, spec, status = deployment["metadata"], deployment.get("spec", {}), deployment.get("status", {})
    namespace = meta.get("namespace", "default")
    desired = spec.get("replicas", 1)
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    total = status.get("replicas", 0)
    current = current_replicaset(deployment, replicasets)
    new_pods = [p for p in pods if current is not None and owned_by(p, current)]
    summary = [_pod_summary(p) for p in new_pods]
    common = {
        "revision": meta.get("annotations", {}).get(REVISION_ANNOTATION),
        "updated": updated,
        "available": available,
        "desired": desired,
        "pods": summary,
    }

    if meta.get("generation", 0) > status.get("observedGeneration", -1):
        return RolloutState("progressing", "waiting for the controller to observe the new spec", **common)
    for pod in new_pods:
        problem = pod_problem(pod, namespace)
        if problem:
            return RolloutState("failed", problem[1], reason=problem[0], **common)
    progressing = _condition(deployment, "Progressing")
    if progressing.get("reason") == "ProgressDeadlineExceeded" and not _stale_deadline(progressing, current):
        detail = "; ".join(s["detail"] for s in summary if s["detail"]) or "no pod reason reported"
        return RolloutState(
            "failed",
            f"the rollout made no progress for progress_deadline_seconds ({progressing.get('message', '')}); "
            f"pods: {detail}",
            reason="ProgressDeadlineExceeded",
            **common,
        )
    if updated < desired:
        return RolloutState("progressing", f"{updated} of {desired} replicas updated", **common)
    if total > updated:
        return RolloutState("progressing", f"{total - updated} old replicas still terminating", **common)
    if available < updated:
        return RolloutState("progressing", f"{available} of {updated} updated replicas available", **common)
    return RolloutState("done", f"{available} of {desired} replicas available", **common)


def _pod_summary(pod: dict[str, Any]) -> dict[str, Any]:
    status = pod.get("status", {})
    detail = ""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        detail = f"unschedulable: {scheduled.get('message', scheduled.get('reason', ''))}"
    for cs in status.get("containerStatuses", []) or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            detail = f"{waiting.get('reason', 'waiting')}: {waiting.get('message', '')}".strip(": ")
    return {
        "name": pod.get("metadata", {}).get("name"),
        "phase": status.get("phase", "Pending"),
        "ready": _condition(pod, "Ready").get("status") == "True",
        "detail": detail,
    }


def watch(
    fetch: Callable[[], tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]],
    *,
    timeout: float,
    on_change: Callable[[RolloutState], None] | None = None,
    first_interval: float = 0.2,
    max_interval: float = 2.0,
) -> RolloutState:
    """Poll ``fetch()`` (deployment, replicasets, pods) until the rollout is done or failed, or ``timeout``.

    The interval starts at ``first_interval`` (a rollout that succeeds at once returns at once) and
    grows to ``max_interval``. At the deadline the state is returned as failed, reason ``Timeout``.
    """
    poll = Poll(first_interval, max_interval, timeout=timeout)
    last_message = None
    while True:
        state = assess(*fetch())
        if state.message != last_message and on_change:
            on_change(state)
        last_message = state.message
        if state.phase != "progressing":
            return state
        if poll.expired():
            detail = "; ".join(f"{p['name']}: {p['detail']}" for p in state.pods if p["detail"])
            return RolloutState(
                "failed",
                f"the rollout did not finish within {timeout:.0f} s: {state.message}"
                + (f"; {detail}" if detail else ""),
                reason="Timeout",
                revision=state.revision,
                updated=state.updated,
                available=state.available,
                desired=state.desired,
                pods=state.pods,
            )
        poll.wait()
