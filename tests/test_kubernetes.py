"""The KubernetesCluster block against the local control plane (`make k8s-up`: a real Kubernetes 1.20
kube-apiserver, controller-manager and scheduler on etcd, plus the kubelet stand-in's GPU node).

Each test works in its own namespace, deleted at the end. The control-plane scenarios use images of
registry.example.com, whose pods the stand-in only simulates (Running/Ready at once; a registry host
that cannot resolve, registry.invalid, fails to pull). ``test_real_server_*`` runs the real
inference server image with podman (the registry stack must be up) and readiness is the server's.
"""

from __future__ import annotations

import http.server
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from blocks import k8s_manifests as m
from blocks.docker_image import DockerImageBuilder
from blocks.errors import ConfigurationError, DeployFailed, TransientError
from blocks.k8s_api import ApplyConflict
from blocks.kubernetes import KubernetesCluster, RolledBack
from blocks.serving import Release
from blocks.specs import ImageRef, ServingSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GOOD = "registry.example.com/gpuferry/serve@sha256:" + "1" * 64
GOOD_2 = "registry.example.com/gpuferry/serve@sha256:" + "2" * 64
# A registry host that cannot resolve (RFC 2606): no kubelet can pull from it.
MISSING = "registry.invalid/gpuferry/serve@sha256:" + "e" * 64


def release(version: str, image: str = GOOD) -> Release:
    return Release(
        model_name="digits-mlp", version=version, model_uri=f"s3://models/digits/{version}",
        image=ImageRef(builder="test", content_tag=version, reference=image, built=True),
    )  # fmt: skip


SMOKE = {"inputs": [[0.0, 0.0, 0.0]]}


def admin(k8s: dict[str, str], **fields: Any) -> KubernetesCluster:
    return KubernetesCluster(kubeconfig=SecretStr(Path(k8s["KUBECONFIG"]).read_text()), **fields)


def cluster(k8s: dict[str, str], namespace: str, **fields: Any) -> KubernetesCluster:
    fields = {"rollout_timeout_seconds": 90, "cpu_request": "10m", "memory_request": "16Mi", **fields}
    return admin(k8s, namespace=namespace, **fields)


def deployment(block: KubernetesCluster, name: str) -> dict[str, Any]:
    return block._api().get(f"/apis/apps/v1/namespaces/{block.namespace}/deployments/{name}")


def replicasets(block: KubernetesCluster, name: str) -> list[dict[str, Any]]:
    return block._replicasets(name)


def ready_pods(block: KubernetesCluster, name: str) -> list[dict[str, Any]]:
    pods = block._api().get(f"/api/v1/namespaces/{block.namespace}/pods", labelSelector=m.label_selector(name))["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]  # fmt: skip


# ---- first deploy, rolling update, same version again, MIG -------------------------------------------


def test_deploy_update_and_redeploy_same_version(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    spec = ServingSpec(service_name="digits", replicas=2, mig_profile="1g.10gb")

    first = block.deploy(spec, release("1"))
    assert first.model_version == "1" and first.previous_version is None and first.detail["changed"] is True
    assert first.url == f"http://digits.{k8s_namespace}.svc.cluster.local:80"
    dep = deployment(block, "digits")
    assert dep["status"]["availableReplicas"] == 2
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    managers = {f["manager"] for f in dep["metadata"]["managedFields"] if f["operation"] == "Apply"}
    assert managers == {"gpuferry"}
    pods = ready_pods(block, "digits")
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {k8s["K8S_NODE"]}
    limits = pods[0]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/mig-1g.10gb"] == "1"
    svc = block._api().get(f"/api/v1/namespaces/{k8s_namespace}/services/digits")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"

    # The same version again: nothing changes (no new generation, no new ReplicaSet).
    again = block.deploy(spec, release("1"))
    assert again.detail["changed"] is False and again.previous_version == "1"
    dep_again = deployment(block, "digits")
    assert dep_again["metadata"]["generation"] == dep["metadata"]["generation"]
    assert len(replicasets(block, "digits")) == 1

    # A new model version rolls out; the old ReplicaSet is scaled to zero.
    second = block.deploy(spec, release("2", GOOD_2))
    assert second.model_version == "2" and second.previous_version == "1" and second.detail["changed"] is True
    current = block.current("digits")
    assert current["version"] == "2" and current["image"] == GOOD_2 and current["available_replicas"] == 2
    by_revision = {int(rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"]): rs
                   for rs in replicasets(block, "digits")}  # fmt: skip
    assert sorted(by_revision) == [1, 2]
    assert by_revision[1]["spec"]["replicas"] == 0 and by_revision[2]["spec"]["replicas"] == 2
    pods = ready_pods(block, "digits")
    assert {p["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] for p in pods} == {"2"}

    assert block.undeploy("digits") is True
    assert block.current("digits") is None


# ---- failed rollout → automatic rollback --------------------------------------------------------------


def test_bad_image_rolls_back_and_old_version_keeps_serving(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    spec = ServingSpec(service_name="digits", replicas=2)
    block.deploy(spec, release("1"))
    started = time.monotonic()
    with pytest.raises(RolledBack) as failed:
        block.deploy(spec, release("2", MISSING))
    assert time.monotonic() - started < 60  # the pod reason fails it; no waiting for the progress deadline
    err = failed.value
    assert err.reason == "ImagePullBackOff" and err.rolled_back_to == "1" and err.failed_version == "2"
    assert "cannot pull image registry.invalid" in str(err) and "v1 is available again" in str(err)

    current = block.current("digits")
    assert current["version"] == "1" and current["image"] == GOOD and current["available_replicas"] == 2
    pods = ready_pods(block, "digits")
    assert len(pods) == 2 and {p["spec"]["containers"][0]["image"] for p in pods} == {GOOD}
    # What was rolled back to is the previous revision's template: the v1 ReplicaSet serves again.
    serving = [rs for rs in replicasets(block, "digits") if rs["spec"]["replicas"]]
    assert len(serving) == 1 and serving[0]["spec"]["template"]["spec"]["containers"][0]["image"] == GOOD

    # And the next good version deploys normally after a rollback.
    assert block.deploy(spec, release("3", GOOD_2)).previous_version == "1"


def test_first_deploy_that_fails_has_nothing_to_roll_back(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    with pytest.raises(DeployFailed, match="no previous revision to roll back to") as failed:
        block.deploy(ServingSpec(service_name="digits"), release("1", MISSING))
    assert not isinstance(failed.value, RolledBack)


def test_hpa_and_pdb_in_the_api_versions_the_server_serves(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace, autoscale_max_replicas=3, pdb_min_available=1)
    block.deploy(ServingSpec(service_name="digits", replicas=1), release("1"))
    groups = {g["name"]: [v["version"] for v in g["versions"]] for g in block._api().get("/apis")["groups"]}
    hpa_version = next(v for v in ("v2", "v2beta2") if v in groups["autoscaling"])
    pdb_version = next(v for v in ("v1", "v1beta1") if v in groups["policy"])
    hpa_path = f"/apis/autoscaling/{hpa_version}/namespaces/{k8s_namespace}/horizontalpodautoscalers/digits"
    hpa = block._api().get(hpa_path)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    pdb = block._api().get(f"/apis/policy/{pdb_version}/namespaces/{k8s_namespace}/poddisruptionbudgets/digits")
    assert pdb["spec"]["minAvailable"] == 1
    # The HPA owns .spec.replicas: our field manager does not.
    dep = deployment(block, "digits")
    ours = next(f for f in dep["metadata"]["managedFields"] if f["manager"] == "gpuferry")
    assert "f:replicas" not in ours["fieldsV1"]["f:spec"]
    assert block.undeploy("digits") is True
    pdb_path = f"/apis/policy/{pdb_version}/namespaces/{k8s_namespace}/poddisruptionbudgets/digits"
    assert block._api().get_or_none(pdb_path) is None


# ---- preflight and validation -------------------------------------------------------------------------


def test_no_node_offers_the_gpu_resource(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    for spec, resource in ((ServingSpec(service_name="digits", mig_profile="2g.20gb"), "nvidia.com/mig-2g.20gb"),
                           (ServingSpec(service_name="digits", gpus=8), "nvidia.com/gpu"),
                           (ServingSpec(service_name="digits", gpus=1), "nvidia.com/gpu.shared")):  # fmt: skip
        b = cluster(k8s, k8s_namespace, gpu_resource=resource) if resource.endswith("shared") else block
        with pytest.raises(ConfigurationError, match=f"no schedulable node offers .* {resource} .*nvidia.com/gpu=") as e:
            b.deploy(spec, release("1"))
        assert k8s["K8S_NODE"] in str(e.value)
    # Nothing was applied.
    assert block._api().get_or_none(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits") is None
    with pytest.raises(ConfigurationError, match="node_selector"):
        cluster(k8s, k8s_namespace, node_selector={"pool": "a100"}).deploy(ServingSpec(service_name="digits", gpus=1),
                                                                            release("1"))  # fmt: skip


def test_mig_typo_fails_before_any_call(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    typo = ServingSpec.model_construct(**{**ServingSpec(service_name="digits").model_dump(), "mig_profile": "1g.10g"})
    api = block._api()
    before = api.attempts
    with pytest.raises(ConfigurationError, match="'1g.10g' is not a MIG profile"):
        block.deploy(typo, release("1"))
    assert api.attempts == before


def test_missing_namespace_is_a_clear_error(k8s: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="namespace='nope-404' does not exist"):
        cluster(k8s, "nope-404").deploy(ServingSpec(service_name="digits"), release("1"))


# ---- server-side apply conflict ---------------------------------------------------------------------


def test_conflict_with_another_field_manager(k8s: dict[str, str], k8s_namespace: str) -> None:
    block = cluster(k8s, k8s_namespace)
    spec = ServingSpec(service_name="digits", replicas=1)
    block.deploy(spec, release("1"))
    # Another team takes over .spec.replicas with its own field manager.
    path = f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits"
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "digits"}, "spec": {"replicas": 3}}
    block._api().apply(path, other, field_manager="other-team", force=True)

    with pytest.raises(ApplyConflict, match="other-team") as conflict:
        block.deploy(ServingSpec(service_name="digits", replicas=2), release("1"))
    assert "force_conflicts" in str(conflict.value) and ".spec.replicas" in str(conflict.value)
    assert isinstance(conflict.value, ConfigurationError)
    assert deployment(block, "digits")["spec"]["replicas"] == 3  # nothing of ours was applied

    forced = cluster(k8s, k8s_namespace, force_conflicts=True).deploy(
        ServingSpec(service_name="digits", replicas=2), release("1")
    )
    assert forced.detail["available_replicas"] == 2


# ---- transient API failures ---------------------------------------------------------------------------


class FlakyProxy:
    """Plain HTTP on loopback → the API server over TLS (client certificate), failing requests on demand."""

    def __init__(self, k8s: dict[str, str]) -> None:
        ctx = ssl.create_default_context(cafile=k8s["K8S_CA_FILE"])
        ctx.load_cert_chain(k8s["K8S_CLIENT_CERT"], k8s["K8S_CLIENT_KEY"])
        self.upstream = httpx.Client(base_url=k8s["K8S_API_URL"], verify=ctx, timeout=30)
        self.plan: list[str] = []  # per coming request: "503", "hang" (longer than the client's timeout)
        self.injected: list[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                with proxy.lock:
                    action = proxy.plan.pop(0) if proxy.plan else None
                    if action:
                        proxy.injected.append(f"{action} {self.command} {self.path}")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if action == "503":
                    self._send(503, b'{"kind":"Status","message":"injected"}', "application/json")
                    return
                if action == "hang":
                    time.sleep(3)
                    self.close_connection = True
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "accept")}
                r = proxy.upstream.request(self.command, self.path, content=body or None, headers=headers)
                self._send(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def _send(self, code: int, content: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self) -> str:
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: p, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: p, user: {}}]\n"
            "contexts: [{name: p, context: {cluster: p, user: p}}]\ncurrent-context: p\n"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.upstream.close()


@pytest.fixture
def proxy(k8s: dict[str, str]) -> Iterator[FlakyProxy]:
    p = FlakyProxy(k8s)
    yield p
    p.close()


def test_api_5xx_and_timeouts_are_retried(k8s: dict[str, str], k8s_namespace: str, proxy: FlakyProxy) -> None:
    block = KubernetesCluster(
        kubeconfig=SecretStr(proxy.kubeconfig()), namespace=k8s_namespace, request_timeout_seconds=1.5,
        api_retries=4,
        rollout_timeout_seconds=90, cpu_request="10m", memory_request="16Mi",
    )  # fmt: skip
    # The first requests of the deploy (preflight, discovery, the apply) fail: 503, a hang, 503.
    proxy.plan = ["503", "hang", "503", "503"]
    endpoint = block.deploy(ServingSpec(service_name="digits"), release("1"))
    assert endpoint.model_version == "1"
    assert len(proxy.injected) == 4 and any(i.startswith("hang") for i in proxy.injected)
    assert block.current("digits")["available_replicas"] == 1

    # More failures in a row than retries: a TransientError (the task's retry policy takes over).
    proxy.plan = ["503"] * 5
    with pytest.raises(TransientError, match=r"failed 5 times; last: HTTP 503"):
        block.current("digits")


# ---- the real inference server, run by the stand-in with podman ----------------------------------------


@pytest.fixture(scope="module")
def workload_image(workload_builder: DockerImageBuilder) -> str:
    from blocks.workload import load_workload
    from tests.examples import DIGITS

    reference = workload_builder.build(load_workload(str(DIGITS))).reference
    assert reference and "@sha256:" in reference
    return reference


def _model_dir(tmp_path: Path, scale: int) -> Path:
    """An MLflow model (scikit-learn) that answers ``scale`` × the sum of its three inputs."""
    import mlflow.sklearn
    import numpy as np
    from sklearn.linear_model import LinearRegression

    from blocks.storage import write_manifest

    path = tmp_path / f"model-{scale}"
    x = np.eye(3)
    mlflow.sklearn.save_model(LinearRegression().fit(x, x.sum(axis=1) * scale), str(path), input_example=x[:2],
                              pip_requirements=["scikit-learn"])  # fmt: skip
    write_manifest(path)  # the server serves only a checkpoint with a manifest
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return path


def _answer(url: str) -> float:
    answer = httpx.post(f"{url}/invocations", json={"inputs": [[1.0, 1.0, 1.0]]}, timeout=30)
    assert answer.status_code == 200, answer.text
    return float(answer.json()["predictions"][0])


def _server_url(block: KubernetesCluster, name: str) -> str:
    (pod,) = ready_pods(block, name)
    return f"http://127.0.0.1:{pod['metadata']['annotations']['kubelet-standin.gpuferry.io/host-port']}"


def test_real_server_rollout_and_crash_rollback(
    k8s: dict[str, str], k8s_namespace: str, workload_image: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o755)
    for scale in (1, 2):
        _model_dir(models, scale)
    block = cluster(k8s, k8s_namespace, host_path_mounts={str(models): "/models"}, env={"WARMUP_ITERATIONS": "1"},
                    memory_limit=None, rollout_timeout_seconds=180)  # fmt: skip
    spec = ServingSpec(service_name="digits", replicas=1, ready_timeout_seconds=120, smoke_request=SMOKE)

    def rel(version: str, scale: int) -> Release:
        return Release(model_name="digits-mlp", version=version, model_uri=f"file:///models/model-{scale}",
                       image=ImageRef(builder="docker", content_tag="t", reference=workload_image, built=True))  # fmt: skip

    block.deploy(spec, rel("1", 1))
    url = _server_url(block, "digits")
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    assert _answer(url) == pytest.approx(3.0)

    block.deploy(spec, rel("2", 2))  # rolling: v2 becomes ready (its real /readyz) before v1 goes
    url = _server_url(block, "digits")
    assert _answer(url) == pytest.approx(6.0)

    # v3's server exits at start (a setting it rejects): CrashLoopBackOff → back to v2, still serving.
    crashing = cluster(k8s, k8s_namespace, host_path_mounts={str(models): "/models"},
                       env={"WARMUP_ITERATIONS": "1", "MAX_QUEUE": "0"}, memory_limit=None,
                       rollout_timeout_seconds=180)  # fmt: skip
    with pytest.raises(RolledBack) as failed:
        crashing.deploy(spec, rel("3", 1))
    assert failed.value.reason == "CrashLoopBackOff" and failed.value.rolled_back_to == "2"
    assert "exit code 2" in str(failed.value)
    url = _server_url(block, "digits")
    assert _answer(url) == pytest.approx(6.0)
    assert block.current("digits")["version"] == "2"
    block.undeploy("digits")


# ---- the block as saved configuration ------------------------------------------------------------------


@pytest.mark.usefixtures("prefect_server")
def test_saved_block_keeps_the_kubeconfig_secret_and_deploys(k8s: dict[str, str], k8s_namespace: str) -> None:
    name = f"k8s-{uuid.uuid4().hex[:8]}"
    cluster(k8s, k8s_namespace).save(name)
    loaded = KubernetesCluster.load(name)
    assert "kubeconfig" in KubernetesCluster.model_json_schema()["secret_fields"]
    assert "BEGIN" not in repr(loaded) and "client-key-data" not in repr(loaded)
    assert loaded.kubeconfig.get_secret_value() == Path(k8s["KUBECONFIG"]).read_text()
    assert loaded.deploy(ServingSpec(service_name="digits"), release("1")).model_version == "1"
