"""The checks of a Kubernetes cluster (``KubernetesCluster.self_check``).

The API server answers (its version), the namespace exists, the kubeconfig's user may do everything a deploy
does there (one SelfSubjectAccessReview per verb and resource: nothing is created), the Secrets the pods use
exist, and which nodes offer the GPU and MIG resources a service asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blocks.checks import CheckFailed, Probe, Warn

if TYPE_CHECKING:
    from blocks.kubernetes.api import KubeApi
    from blocks.kubernetes.cluster import KubernetesCluster


def deploy_permissions(cluster: KubernetesCluster) -> list[tuple[str, str, str, bool]]:
    """(verb, API group, resource, namespaced) for every call a deploy (and its rollback, and undeploy) makes."""
    needed = [("get", "", "namespaces", False), ("list", "", "nodes", False)]
    for verb in ("get", "patch", "delete"):
        needed += [(verb, "apps", "deployments", True), (verb, "", "services", True)]
    needed += [("list", "apps", "replicasets", True), ("list", "", "pods", True)]
    # canary and shadow rollouts: the route's ConfigMap, the serving pods told to read it again
    needed += [(verb, "", "configmaps", True) for verb in ("get", "patch", "delete")] + [("patch", "", "pods", True)]
    if cluster.autoscale_max_replicas is not None:
        needed += [
            ("patch", "autoscaling", "horizontalpodautoscalers", True),
            ("delete", "autoscaling", "horizontalpodautoscalers", True),
        ]
    if cluster.pdb_min_available is not None:
        needed += [
            ("patch", "policy", "poddisruptionbudgets", True),
            ("delete", "policy", "poddisruptionbudgets", True),
        ]
    if cluster.env_from_secret is None:  # the store's Secret: made, updated, deleted on undeploy
        needed += [(verb, "", "secrets", True) for verb in ("get", "create", "update", "delete")]
    return needed


def _allowed(api: KubeApi, namespace: str, verb: str, group: str, resource: str, namespaced: bool) -> bool:
    attributes: dict[str, Any] = {"verb": verb, "group": group, "resource": resource}
    if namespaced:
        attributes["namespace"] = namespace
    elif resource == "namespaces":
        attributes["name"] = namespace
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes},
    }
    return bool(api.create(review).get("status", {}).get("allowed"))


def check_kubernetes(cluster: KubernetesCluster, probe: Probe) -> None:
    from blocks.kubernetes.api import KubeApiError

    copy = cluster.model_copy(update={"request_timeout_seconds": probe.left, "api_retries": 0})
    ns = cluster.namespace
    try:
        api = copy._api()
    except Exception as exc:  # noqa: BLE001 - a bad kubeconfig
        probe.add("reach", "failed", str(exc), "fix kubeconfig (the file's content) and context")
        return

    def reach() -> str:
        version = api.server_version()
        return f"{api.conn.server} (Kubernetes {version.get('gitVersion', '?')})"

    try:
        if not probe.step("reach", reach, "start the API server, or fix kubeconfig / context"):
            return

        def namespace() -> str | Warn:
            try:
                found = api.read_or_none("v1", "Namespace", ns)
            except KubeApiError as exc:
                if exc.status == 403:
                    return Warn(f"may not read namespace {ns!r}: {exc}", "the permissions below say what is missing")
                raise
            if found is None:
                raise CheckFailed(
                    f"namespace {ns!r} does not exist", f"kubectl create namespace {ns} (or set namespace)"
                )
            return f"{ns} ({found.get('status', {}).get('phase', '?')})"

        probe.step("namespace", namespace)

        def permissions() -> str:
            needed = deploy_permissions(cluster)
            missing = [(v, g, r) for v, g, r, namespaced in needed if not _allowed(api, ns, v, g, r, namespaced)]
            if missing:
                names = ", ".join(f"{v} {r}{'.' + g if g else ''}" for v, g, r in missing)
                verbs = sorted({v for v, _, _ in missing})
                resources = sorted({f"{r}{'.' + g if g else ''}" for _, g, r in missing})
                raise CheckFailed(
                    f"{len(missing)} of {len(needed)} permissions missing in {ns}: {names}",
                    f"grant them, e.g. kubectl -n {ns} create role gpuferry-deploy --verb={','.join(verbs)} "
                    f"--resource={','.join(resources)} and a rolebinding to the kubeconfig's user "
                    "(nodes and namespaces need a ClusterRole)",
                )
            return f"all {len(needed)} permissions a deploy needs (SelfSubjectAccessReview)"

        probe.step("RBAC", permissions)
        secrets = [s for s in (cluster.env_from_secret, cluster.image_pull_secret) if s]
        if secrets:

            def present() -> Any:
                absent = [s for s in secrets if api.read_or_none("v1", "Secret", s, namespace=ns) is None]
                if absent:
                    raise CheckFailed(
                        f"Secret {', '.join(absent)} not in namespace {ns}",
                        f"create it: kubectl -n {ns} create secret generic {absent[0]} --from-env-file=FILE",
                    )
                return f"{', '.join(secrets)} present"

            probe.step("Secrets", present, "let the user get secrets in the namespace, or create them")

        def nodes() -> Any:
            try:
                items = api.items("v1", "Node")
            except KubeApiError as exc:
                if exc.status == 403:
                    return Warn(f"may not list nodes: {exc}", "the RBAC row says what is missing")
                raise
            offered = []
            for node in items:
                if node.get("spec", {}).get("unschedulable"):
                    continue
                allocatable = node.get("status", {}).get("allocatable", {})
                gpu = {
                    k: v
                    for k, v in allocatable.items()
                    if k == cluster.gpu_resource or k.startswith(cluster.mig_resource_prefix)
                }
                if gpu:
                    offered.append(
                        f"{node['metadata']['name']}: " + ", ".join(f"{k}={v}" for k, v in sorted(gpu.items()))
                    )
            if not offered:
                return Warn(
                    f"none of {len(items)} schedulable nodes offers {cluster.gpu_resource} or "
                    f"{cluster.mig_resource_prefix}*",
                    "services with gpus or mig_profile cannot be "
                    "scheduled: add GPU nodes (NVIDIA device plugin), or serve on CPUs",
                )
            return "; ".join(offered)

        probe.step("GPU nodes", nodes)
    finally:
        api.close()
