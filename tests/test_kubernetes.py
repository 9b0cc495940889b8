"""The KubernetesCluster block against the local cluster (`make k8s-up`): a real Kubernetes 1.20 control plane
and one real node (kubelet, containerd, kube-proxy, a device plugin with fake GPUs and MIG slices).

Each test works in its own namespace, deleted at the end, with an image pull secret for the registry stack.
Every pod runs the real inference server image (built and pushed once per session), which loads a small
checkpoint from a host directory mounted into the pod; readiness, restarts, OOM kills and image pulls are the
kubelet's own. Pods are reached only through the API server's pod proxy, or from inside the node's network
namespace (the Service's ClusterIP).
"""

from __future__ import annotations

import base64
import http.server
import json
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from blocks.base.serving import Release
from blocks.errors import ConfigurationError, DeployFailed, RolledBack, TransientError
from blocks.kubernetes import manifests as m
from blocks.kubernetes.api import ApplyConflict
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.records import ImageRef
from blocks.specs import ServingSpec
from blocks.storage.s3 import S3CheckpointStore
from tests.k8s_node import (
    PULL_SECRET,
    ServiceLoad,
    in_pod,
    in_pod_env,
    in_pod_gpu_nodes,
    pods,
    ready_pods,
    write_test_models,
)
from tests.private_worker import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# For tests that fail before anything is applied: no node ever pulls it.
UNPULLED = "127.0.0.1:5090/gpuferry-test/never-pulled@sha256:" + "1" * 64
HIDDEN = (16, 24, 32)  # the test checkpoints: one MLP per hidden width

Rel = Callable[..., Release]


# A request the test models answer (64 features, two rows): the smoke request of every deploy here.
SMOKE = {"inputs": [[0.0] * 64, [1.0] * 64]}
CHECKPOINTS: dict[str, int] = {}  # the test checkpoints' sha256 (what /readyz names) -> their hidden width


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of small MLflow models (model-16/, model-24/, ...), each with its manifest, for the pods."""
    root = tmp_path_factory.mktemp("models")
    CHECKPOINTS.update(write_test_models(root, HIDDEN))
    return root


@pytest.fixture
def rel(workload_image: str) -> Rel:
    """``rel(version, hidden=16, image=<the workload image>)``: a release of the checkpoint model-<hidden>."""

    def make(version: str, hidden: int = 16, image: str | None = None) -> Release:
        return Release(
            model_name="digits-mlp",
            version=version,
            model_uri=f"file:///models/model-{hidden}",
            image=ImageRef(builder="docker", content_tag=version, reference=image or workload_image, built=True),
        )

    return make


def admin(k8s: dict[str, str], **fields: Any) -> KubernetesCluster:
    return KubernetesCluster(**{"kubeconfig": SecretStr(Path(k8s["KUBECONFIG"]).read_text()), **fields})


@pytest.fixture
def cluster(k8s: dict[str, str], k8s_namespace: str, models: Path) -> Callable[..., KubernetesCluster]:
    """``cluster(**fields)``: the block on the test's namespace, pulling with its secret, models mounted."""

    def make(**fields: Any) -> KubernetesCluster:
        # The node's GPUs are stand-ins without CUDA: the servers run their models on the CPU.
        env = {"WARMUP_ITERATIONS": "1", "MODEL_DEVICE": "cpu", **fields.pop("env", {})}
        fields = {
            "rollout_timeout_seconds": 240,
            "cpu_request": "10m",
            "memory_request": "64Mi",
            "image_pull_secret": PULL_SECRET,
            "host_path_mounts": {str(models): "/models"},
            "env": env,
            **fields,
        }
        return admin(k8s, namespace=k8s_namespace, **fields)

    return make


def deployment(block: KubernetesCluster, name: str) -> dict[str, Any]:
    return block._api().get(f"/apis/apps/v1/namespaces/{block.namespace}/deployments/{name}")


def replicasets(block: KubernetesCluster, name: str) -> list[dict[str, Any]]:
    return block._replicasets(name)


def served_checkpoint(block: KubernetesCluster, pod: dict[str, Any]) -> str:
    """The sha256 of the checkpoint the pod's server loaded (its manifest's), as its /readyz names it."""
    status, body = block.pod_request(pod["metadata"]["name"], "/readyz")
    assert status == 200, body
    return body["model"]["checkpoint_sha256"]


def served_hidden(block: KubernetesCluster, pod: dict[str, Any]) -> int:
    return CHECKPOINTS[served_checkpoint(block, pod)]


def predictions_answered(block: KubernetesCluster, pod: dict[str, Any]) -> int:
    """The pod's count of /invocations requests answered 200 (its /metrics)."""
    status, text = block.pod_request(pod["metadata"]["name"], "/metrics")
    assert status == 200
    found = re.search(r'^inference_requests_total\{code="200"\} (\d+)', text, re.M)
    return int(found.group(1)) if found else 0


# ---- first deploy, rolling update, same version again; MIG and whole GPUs -----------------------------


def test_deploy_update_and_redeploy_same_version_on_mig_slices(
    k8s: dict[str, str], k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    block = cluster()
    spec = ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=2, mig_profile="1g.10gb")

    first = block.deploy(spec, rel("1", 16))
    assert first.model_version == "1" and first.previous_version is None and first.detail["changed"] is True
    assert first.url == f"http://digits.{k8s_namespace}.svc.cluster.local:80"
    dep = deployment(block, "digits")
    assert dep["status"]["availableReplicas"] == 2
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    managers = {f["manager"] for f in dep["metadata"]["managedFields"] if f["operation"] == "Apply"}
    assert managers == {"gpuferry"}
    pods = ready_pods(block, "digits")
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {k8s["K8S_NODE"]}
    assert {served_hidden(block, p) for p in pods} == {16}
    # Each replica got a MIG slice of its own from the device plugin, and sees it inside the container.
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    slices = [in_pod_env(k8s, k8s_namespace, p, "NVIDIA_VISIBLE_DEVICES") for p in pods]
    assert all(re.fullmatch(r"MIG-fake-\S+-1g\.10gb-\d+", s) for s in slices) and len(set(slices)) == 2, slices
    # ... and its device nodes: nvidiactl, the parent GPU (one not offered whole) and the capability nodes of
    # the slice's GPU instance and compute instance, numbered as the driver numbers them (mig-minors).
    for pod, mig in zip(pods, slices, strict=True):
        k = int(mig.rsplit("-", 1)[1])
        parent, gi = int(k8s["K8S_NODE_GPUS"]) + k // 7, 7 + k % 7
        gi_cap = 3 + 135 * parent + 9 * gi
        nodes = in_pod_gpu_nodes(k8s, k8s_namespace, pod)
        caps_major = nodes.get(f"/dev/nvidia-caps/nvidia-cap{gi_cap}", (None,))[0]
        assert nodes == {
            "/dev/nvidiactl": (195, 255),
            f"/dev/nvidia{parent}": (195, parent),
            f"/dev/nvidia-caps/nvidia-cap{gi_cap}": (caps_major, gi_cap),
            f"/dev/nvidia-caps/nvidia-cap{gi_cap + 1}": (caps_major, gi_cap + 1),
        }, (mig, nodes)
    # The smoke request went through the API server to one of the new pods.
    assert sum(predictions_answered(block, p) for p in pods) == 1

    # The same version again: nothing changes (no new generation, no new ReplicaSet, no smoke request).
    again = block.deploy(spec, rel("1", 16))
    assert again.detail["changed"] is False and again.previous_version == "1"
    assert deployment(block, "digits")["metadata"]["generation"] == dep["metadata"]["generation"]
    assert len(replicasets(block, "digits")) == 1
    assert sum(predictions_answered(block, p) for p in ready_pods(block, "digits")) == 1

    # A new model version rolls out; the old ReplicaSet is scaled to zero; the new pods serve the new model.
    second = block.deploy(spec, rel("2", 24))
    assert second.model_version == "2" and second.previous_version == "1" and second.detail["changed"] is True
    current = block.current("digits")
    assert current["version"] == "2" and current["available_replicas"] == 2
    by_revision = {
        int(rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"]): rs
        for rs in replicasets(block, "digits")
    }
    assert sorted(by_revision) == [1, 2]
    assert by_revision[1]["spec"]["replicas"] == 0 and by_revision[2]["spec"]["replicas"] == 2
    pods = ready_pods(block, "digits")
    assert {p["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] for p in pods} == {"2"}
    assert {served_hidden(block, p) for p in pods} == {24}
    assert sum(predictions_answered(block, p) for p in pods) == 1

    assert block.undeploy("digits") is True
    assert block.current("digits") is None


def test_whole_gpus_are_allocated_and_seen_inside_the_pod(
    k8s: dict[str, str], k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    block = cluster()
    block.deploy(ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=1, gpus=2), rel("1"))
    (pod,) = ready_pods(block, "digits")
    devices = in_pod_env(k8s, k8s_namespace, pod, "NVIDIA_VISIBLE_DEVICES").split(",")
    assert len(devices) == 2 and all(re.fullmatch(r"GPU-fake-\S+-\d", d) for d in devices), devices
    # The container has the device nodes of those two GPUs (and nvidiactl), and no other GPU's.
    chosen = sorted(int(d.rsplit("-", 1)[1]) for d in devices)
    expected = {"/dev/nvidiactl": (195, 255), **{f"/dev/nvidia{i}": (195, i) for i in chosen}}
    assert in_pod_gpu_nodes(k8s, k8s_namespace, pod) == expected
    block.undeploy("digits")


# ---- failed rollout → automatic rollback --------------------------------------------------------------


def test_bad_image_rolls_back_and_old_version_keeps_serving(
    k8s: dict[str, str], cluster: Callable[..., KubernetesCluster], rel: Rel, workload_image: str
) -> None:
    block = cluster()
    spec = ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=2)
    block.deploy(spec, rel("1", 16))
    missing = workload_image.split("@")[0].rsplit("/", 1)[0] + "/does-not-exist@sha256:" + "e" * 64
    started = time.monotonic()
    with pytest.raises(RolledBack) as failed:
        block.deploy(spec, rel("2", 24, image=missing))
    assert time.monotonic() - started < 180  # the pod's reason fails it; no waiting for the progress deadline
    err = failed.value
    assert err.reason == "ImagePullBackOff" and err.rolled_back_to == "1" and err.failed_version == "2"
    assert f"cannot pull image {missing.split('@')[0]}" in str(err) and "v1 is available again" in str(err)

    current = block.current("digits")
    assert current["version"] == "1" and current["image"] == workload_image and current["available_replicas"] == 2
    pods = ready_pods(block, "digits")
    assert len(pods) == 2 and {p["spec"]["containers"][0]["image"] for p in pods} == {workload_image}
    assert {served_hidden(block, p) for p in pods} == {16}
    # What was rolled back to is the previous revision's template: the v1 ReplicaSet serves again.
    serving = [rs for rs in replicasets(block, "digits") if rs["spec"]["replicas"]]
    assert len(serving) == 1 and serving[0]["spec"]["template"]["spec"]["containers"][0]["image"] == workload_image

    # And the next good version deploys normally after a rollback.
    assert block.deploy(spec, rel("3", 32)).previous_version == "1"


def test_the_stores_credentials_reach_the_pods_in_a_secret_of_the_deploys_own(
    k8s: dict[str, str], k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    block = cluster()
    api, spec = block._api(), ServingSpec(service_name="digits", smoke_request=SMOKE)
    secret_path = f"/api/v1/namespaces/{k8s_namespace}/secrets/{m.store_secret_name(spec)}"
    planted = "planted-" + uuid.uuid4().hex
    store_env = {"AWS_ACCESS_KEY_ID": SecretStr("gpuferry-test"), "AWS_SECRET_ACCESS_KEY": SecretStr(planted)}
    block.deploy(spec, rel("1").model_copy(update={"store_env": store_env}))
    secret = api.get(secret_path)
    assert m.is_ours(secret) and base64.b64decode(secret["data"]["AWS_SECRET_ACCESS_KEY"]).decode() == planted
    (pod,) = ready_pods(block, "digits")
    assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "digits-model-store"}}]
    assert in_pod_env(k8s, k8s_namespace, pod, "AWS_SECRET_ACCESS_KEY").strip() == planted
    dep = deployment(block, "digits")
    assert planted not in json.dumps(dep) and planted not in json.dumps(pod)  # only the reference

    # The same keys again: nothing changes; rotated keys: the Secret is updated and the pods restart with them.
    assert block.deploy(spec, rel("1").model_copy(update={"store_env": store_env})).detail["changed"] is False
    rotated = {**store_env, "AWS_SECRET_ACCESS_KEY": SecretStr(planted + "-rotated")}
    assert block.deploy(spec, rel("1").model_copy(update={"store_env": rotated})).detail["changed"] is True
    (pod,) = ready_pods(block, "digits")
    assert in_pod_env(k8s, k8s_namespace, pod, "AWS_SECRET_ACCESS_KEY").strip() == planted + "-rotated"

    block.undeploy("digits")
    assert api.get_or_none(secret_path) is None
    # A Secret of that name that is not gpuferry's is left alone: a clear error before anything is applied.
    api.request(
        "POST",
        secret_path.rsplit("/", 1)[0],
        body={
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "digits-model-store"},
            "stringData": {"K": "v"},
        },
    )
    with pytest.raises(ConfigurationError, match="digits-model-store exists and is not gpuferry's"):
        block.deploy(spec, rel("1").model_copy(update={"store_env": store_env}))
    assert block.current("digits") is None and api.get(secret_path)["data"] == {"K": "dg=="}


def make_ca(path: Path, name: str) -> bytes:
    """A CA certificate (PEM) at ``path``, as a store with a private CA has one (its key thrown away)."""
    import subprocess

    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(path.with_suffix(".key")),
            "-out",
            str(path),
            "-subj",
            f"/CN={name}",
            "-days",
            "2",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return path.read_bytes()


# Inside the pod: the certificate AWS_CA_BUNDLE names loads as a CA (what boto3's verify= does with it).
_LOAD_CA = "import os, ssl; print(len(ssl.create_default_context(cafile=os.environ['AWS_CA_BUNDLE']).get_ca_certs()))"


def test_the_stores_ca_reaches_the_pods_as_a_file_and_a_new_one_restarts_them(
    k8s: dict[str, str], k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel, tmp_path: Path
) -> None:
    block = cluster()
    api, spec = block._api(), ServingSpec(service_name="digits", smoke_request=SMOKE)
    secret_path = f"/api/v1/namespaces/{k8s_namespace}/secrets/{m.store_secret_name(spec)}"
    ca = tmp_path / "store-ca.pem"
    first = make_ca(ca, "first store CA")
    planted = "planted-" + uuid.uuid4().hex
    store_env = {
        "AWS_ACCESS_KEY_ID": SecretStr("gpuferry-test"),
        "AWS_SECRET_ACCESS_KEY": SecretStr(planted),
        "AWS_CA_BUNDLE": SecretStr(str(ca)),
    }
    block.deploy(spec, rel("1").model_copy(update={"store_env": store_env}))
    secret = api.get(secret_path)
    assert base64.b64decode(secret["data"][m.STORE_CA_KEY]) == first and "AWS_CA_BUNDLE" not in secret["data"]
    (pod,) = ready_pods(block, "digits")
    assert in_pod_env(k8s, k8s_namespace, pod, "AWS_CA_BUNDLE") == m.STORE_CA_PATH
    assert in_pod(k8s, k8s_namespace, pod, "cat", m.STORE_CA_PATH) == first.decode().strip()
    assert in_pod(k8s, k8s_namespace, pod, "python", "-c", _LOAD_CA) == "1"
    assert in_pod_env(k8s, k8s_namespace, pod, "AWS_SECRET_ACCESS_KEY") == planted
    assert "BEGIN CERTIFICATE" not in in_pod(k8s, k8s_namespace, pod, "env")  # a file, not also a variable
    assert planted not in json.dumps(deployment(block, "digits")) and planted not in json.dumps(pod)

    # A new CA at the same path: the Secret changes and the pods restart with it.
    second = make_ca(ca, "second store CA")
    assert block.deploy(spec, rel("1").model_copy(update={"store_env": store_env})).detail["changed"] is True
    (pod,) = ready_pods(block, "digits")
    assert in_pod(k8s, k8s_namespace, pod, "cat", m.STORE_CA_PATH) == second.decode().strip()
    block.undeploy("digits")
    assert api.get_or_none(secret_path) is None


def node_certificate(tmp: Path, address: str) -> tuple[Path, Path]:
    """A certificate (and its key) for ``address``, signed by the s3 stack's own CA: what a store's private CA
    signs for the address its clients use."""
    import subprocess

    from tests.stacks import stacks_root

    ca = stacks_root() / "s3" / "tls"
    key, csr, cert, ext = (tmp / name for name in ("node.key", "node.csr", "node.crt", "node.ext"))
    ext.write_text(f"subjectAltName=IP:{address}\nbasicConstraints=critical,CA:FALSE\n")
    for cmd in (
        [
            "openssl",
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            f"/CN={address}",
        ],
        [
            "openssl",
            "x509",
            "-req",
            "-sha256",
            "-days",
            "2",
            "-in",
            str(csr),
            "-CA",
            str(ca / "ca.crt"),
            "-CAkey",
            str(ca / "ca.key"),
            "-set_serial",
            f"0x{uuid.uuid4().hex}",
            "-extfile",
            str(ext),
            "-out",
            str(cert),
        ],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return cert, key


def store_over_https(store: S3CheckpointStore, endpoint: str, ca: Path) -> S3CheckpointStore:
    """``store`` as a user with an https endpoint and a private CA configures it: the endpoint and the CA's file
    in the credentials' client parameters."""
    params = store.bucket.credentials.aws_client_parameters.model_copy(
        update={"endpoint_url": endpoint, "verify_cert_path": str(ca)}
    )
    credentials = store.bucket.credentials.model_copy(update={"aws_client_parameters": params})
    return store.model_copy(update={"bucket": store.bucket.model_copy(update={"credentials": credentials})})


def test_a_pod_fetches_its_checkpoint_over_https_trusting_the_stores_ca_file(
    k8s: dict[str, str],
    cluster: Callable[..., KubernetesCluster],
    models: Path,
    s3_store: S3CheckpointStore,
    workload_image: str,
    tmp_path: Path,
) -> None:
    """A user's MinIO or Ceph behind a private CA: the store block's https endpoint and ``verify_cert_path`` are all
    the pods get (``reader_env``), and the server fetches and checks the checkpoint from there at start-up. The
    s3 stack's own certificate names only loopback, which pods do not share: they reach the stack through a relay
    in the node that presents a certificate for the node's address, signed by the stack's CA. With a CA that did
    not sign it, the pod refuses the store and the deploy rolls back."""
    from tests.k8s_node import TlsNodeRelay
    from tests.stacks import s3_target, stacks_root

    ref = s3_store.put(models / "model-16", f"https-{uuid.uuid4().hex[:8]}")
    cert, key = node_certificate(tmp_path, k8s["K8S_NODE_IP"])
    relay = TlsNodeRelay(k8s["K8S_NODE_NETNS"], k8s["K8S_NODE_IP"], s3_target(), cert, key)
    try:
        endpoint = f"https://{relay.address[0]}:{relay.address[1]}"
        trusted = store_over_https(s3_store, endpoint, stacks_root() / "s3" / "tls" / "ca.crt")

        def release(version: str, store: S3CheckpointStore) -> Release:
            return Release(
                model_name="digits-mlp",
                version=version,
                model_uri=ref.uri,
                checkpoint_sha256=ref.sha256,
                image=ImageRef(builder="docker", content_tag=version, reference=workload_image, built=True),
                store_env=store.reader_env(),
            )

        block, spec = cluster(), ServingSpec(service_name="digits", smoke_request=SMOKE, ready_timeout_seconds=120)
        block.deploy(spec, release("1", trusted))
        (pod,) = ready_pods(block, "digits")
        assert served_checkpoint(block, pod) == ref.sha256  # fetched from the store, checked against the manifest
        assert relay.handshakes >= 1 and relay.refused == 0

        other = tmp_path / "other-ca.pem"
        make_ca(other, "a CA that signed nothing of the store's")
        with pytest.raises(RolledBack) as refused:
            block.deploy(spec, release("2", store_over_https(s3_store, endpoint, other)))
        # The server exits when it cannot fetch its checkpoint; the relay saw its TLS client refuse the certificate.
        assert refused.value.reason == "CrashLoopBackOff" and refused.value.rolled_back_to == "1"
        assert relay.refused >= 1
        (pod,) = ready_pods(block, "digits")
        assert served_checkpoint(block, pod) == ref.sha256
    finally:
        relay.close()


def test_first_deploy_that_fails_has_nothing_to_roll_back(
    cluster: Callable[..., KubernetesCluster], rel: Rel, workload_image: str
) -> None:
    missing = workload_image.split("@")[0] + "-missing@sha256:" + "e" * 64
    with pytest.raises(DeployFailed, match="no previous revision to roll back to") as failed:
        cluster().deploy(ServingSpec(service_name="digits", smoke_request=SMOKE), rel("1", image=missing))
    assert not isinstance(failed.value, RolledBack) and "ImagePullBackOff" in str(failed.value)


def test_crash_oom_and_never_ready_each_roll_back(cluster: Callable[..., KubernetesCluster], rel: Rel) -> None:
    spec = ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=1, ready_timeout_seconds=60)
    block = cluster()
    block.deploy(spec, rel("1", 16))

    # v2's server exits at start (a setting it rejects): CrashLoopBackOff.
    with pytest.raises(RolledBack) as crashed:
        cluster(env={"MAX_QUEUE": "0"}).deploy(spec, rel("2", 24))
    assert crashed.value.reason == "CrashLoopBackOff" and crashed.value.rolled_back_to == "1"
    assert "exit code 2" in str(crashed.value)

    # v3's server needs more memory than its limit: the kernel kills it, the kubelet says OOMKilled.
    with pytest.raises(RolledBack) as oom:
        cluster(memory_limit="40Mi", memory_request="40Mi").deploy(spec, rel("3", 24))
    assert oom.value.reason == "OOMKilled" and oom.value.rolled_back_to == "1"
    assert "raise memory_limit" in str(oom.value)

    # v4's server runs but never becomes ready (its warm-up never ends): its readiness probe never passes,
    # and the Deployment's progress deadline fails the rollout.
    never = cluster(env={"WARMUP_ITERATIONS": "1000000000"}, cpu_limit="200m", progress_deadline_seconds=20)
    with pytest.raises(RolledBack) as unready:
        never.deploy(spec, rel("4", 24))
    assert unready.value.reason == "ProgressDeadlineExceeded" and unready.value.rolled_back_to == "1"
    assert "made no progress" in str(unready.value)

    (pod,) = ready_pods(block, "digits")
    assert served_hidden(block, pod) == 16 and block.current("digits")["version"] == "1"


# ---- traffic through the Service while versions change -------------------------------------------------


def test_no_failed_request_through_the_service_during_a_rollout_and_a_rollback(
    k8s: dict[str, str], k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel, models: Path
) -> None:
    block = cluster()
    spec = ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=2)
    block.deploy(spec, rel("1", 16))
    svc = block._api().get(f"/api/v1/namespaces/{k8s_namespace}/services/digits")
    url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
    load = ServiceLoad(k8s["K8S_NODE_NETNS"], url, {"inputs": [[0.5] * 64]}, rate=20, max_seconds=300).start()
    try:
        _wait_for_answers(load, 20)
        # A rolling update to v2, under load.
        block.deploy(spec, rel("2", 24))
        # A v3 whose smoke request fails (it has 3 features, the model takes 64) after its pods became ready
        # and took traffic: the rollback moves the traffic back to v2, under load.
        bad_smoke = spec.model_copy(update={"smoke_request": {"inputs": [[0.0, 1.0, 2.0]]}})
        with pytest.raises(RolledBack) as failed:
            block.deploy(bad_smoke, rel("3", 32))
        # Once v3's pods are gone (they drain first), every answer is v2's.
        wait_until(
            "v3's pods to be gone",
            lambda: (
                not [
                    p for p in pods(block, "digits") if p["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "3"
                ]
            ),
            timeout=120,
        )
        after = len(load.answers)
        _wait_for_answers(load, after + 40)
    finally:
        answers = load.stop()
    assert failed.value.reason == "SmokeTestFailed" and failed.value.rolled_back_to == "2"
    assert "smoke test: /invocations answered 422" in str(failed.value)

    assert load.failed == [], load.failed[:5]
    uri = CHECKPOINTS
    seen = [uri[u] for _, u in load.models()]
    # Versions follow the deploys: v1, v2, then v3 (it served once its pods were ready, before its smoke test
    # failed), then v2 again; nothing else, and v2 alone once v3's pods were gone.
    assert [h for i, h in enumerate(seen) if i == 0 or seen[i - 1] != h] == [16, 24, 32, 24], seen
    assert {uri[u] for at, u in load.models() if at >= answers[after].at} == {24}
    assert len(answers) >= 100


def _wait_for_answers(load: ServiceLoad, count: int) -> None:
    wait_until(f"{count} answers", lambda: len(load.answers) >= count, timeout=120, interval=0.2)


# ---- HPA and PDB -------------------------------------------------------------------------------------


def test_hpa_and_pdb_in_the_api_versions_the_server_serves(
    k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    block = cluster(autoscale_max_replicas=3, pdb_min_available=1)
    block.deploy(ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=1), rel("1"))
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


def unpulled(version: str = "1") -> Release:
    return Release(
        model_name="digits-mlp",
        version=version,
        model_uri="file:///models/model-16",
        image=ImageRef(builder="test", content_tag=version, reference=UNPULLED, built=True),
    )


def test_no_node_offers_the_gpu_resource(k8s: dict[str, str], cluster: Callable[..., KubernetesCluster]) -> None:
    block = cluster()
    more = int(k8s["K8S_NODE_GPUS"]) + 1  # more GPUs than the node has
    for spec, resource in (
        (ServingSpec(service_name="digits", smoke_request=SMOKE, mig_profile="2g.20gb"), "nvidia.com/mig-2g.20gb"),
        (ServingSpec(service_name="digits", smoke_request=SMOKE, gpus=more), "nvidia.com/gpu"),
        (ServingSpec(service_name="digits", smoke_request=SMOKE, gpus=1), "nvidia.com/gpu.shared"),
    ):
        b = cluster(gpu_resource=resource) if resource.endswith("shared") else block
        with pytest.raises(
            ConfigurationError, match=f"no schedulable node offers .* {resource} .*nvidia.com/gpu="
        ) as e:
            b.deploy(spec, unpulled())
        assert k8s["K8S_NODE"] in str(e.value)
        assert f"nvidia.com/gpu={k8s['K8S_NODE_GPUS']}" in str(e.value)
        assert f"{k8s['K8S_NODE_MIG_RESOURCE']}={k8s['K8S_NODE_MIG_COUNT']}" in str(e.value)
    # Nothing was applied.
    assert block._api().get_or_none(f"/apis/apps/v1/namespaces/{block.namespace}/deployments/digits") is None
    with pytest.raises(ConfigurationError, match="node_selector"):
        cluster(node_selector={"pool": "a100"}).deploy(
            ServingSpec(service_name="digits", smoke_request=SMOKE, gpus=1), unpulled()
        )


def test_mig_typo_fails_before_any_call(cluster: Callable[..., KubernetesCluster]) -> None:
    block = cluster()
    typo = ServingSpec.model_construct(**{**ServingSpec(service_name="digits").model_dump(), "mig_profile": "1g.10g"})
    api = block._api()
    before = api.attempts
    with pytest.raises(ConfigurationError, match="'1g.10g' is not a MIG profile"):
        block.deploy(typo, unpulled())
    assert api.attempts == before


def test_missing_namespace_is_a_clear_error(k8s: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="namespace='nope-404' does not exist"):
        admin(k8s, namespace="nope-404").deploy(ServingSpec(service_name="digits", smoke_request=SMOKE), unpulled())


# ---- server-side apply conflict ---------------------------------------------------------------------


def test_conflict_with_another_field_manager(
    k8s_namespace: str, cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    block = cluster()
    spec = ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=1)
    block.deploy(spec, rel("1"))
    # Another team takes over .spec.replicas with its own field manager.
    path = f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits"
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "digits"}, "spec": {"replicas": 3}}
    block._api().apply(path, other, field_manager="other-team", force=True)

    with pytest.raises(ApplyConflict, match="other-team") as conflict:
        block.deploy(ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=2), rel("1"))
    assert "force_conflicts" in str(conflict.value) and ".spec.replicas" in str(conflict.value)
    assert isinstance(conflict.value, ConfigurationError)
    assert deployment(block, "digits")["spec"]["replicas"] == 3  # nothing of ours was applied

    forced = cluster(force_conflicts=True).deploy(
        ServingSpec(service_name="digits", smoke_request=SMOKE, replicas=2), rel("1")
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
        self.paths: list[str] = []
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
                    proxy.paths.append(f"{self.command} {self.path}")
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

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any  # noqa: N815 - http.server's handler names

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


def test_api_5xx_and_timeouts_are_retried(
    cluster: Callable[..., KubernetesCluster], proxy: FlakyProxy, rel: Rel
) -> None:
    block = cluster(kubeconfig=SecretStr(proxy.kubeconfig()), request_timeout_seconds=1.5, api_retries=4)
    # The deploy's first request (discovery's GET /version) fails four times: 503, a hang, 503, 503; the fifth
    # attempt (api_retries=4) passes.
    proxy.plan = ["503", "hang", "503", "503"]
    endpoint = block.deploy(ServingSpec(service_name="digits", smoke_request=SMOKE), rel("1"))
    assert endpoint.model_version == "1"
    assert len(proxy.injected) == 4 and any(i.startswith("hang") for i in proxy.injected)
    assert block.current("digits")["available_replicas"] == 1
    # The smoke request went through the API server's pod proxy, to the container port.
    smoke = [p for p in proxy.paths if p.startswith("POST ") and "/proxy/invocations" in p]
    assert len(smoke) == 1 and re.search(r"/pods/digits-[a-z0-9-]+:8080/proxy/invocations$", smoke[0]), smoke

    # More failures in a row than retries: a TransientError (the task's retry policy takes over).
    proxy.plan = ["503"] * 5
    with pytest.raises(TransientError, match=r"failed 5 times; last: HTTP 503"):
        block.current("digits")


# ---- the block as saved configuration ------------------------------------------------------------------


@pytest.mark.usefixtures("prefect_server")
def test_saved_block_keeps_the_kubeconfig_secret_and_deploys(
    k8s: dict[str, str], cluster: Callable[..., KubernetesCluster], rel: Rel
) -> None:
    name = f"k8s-{uuid.uuid4().hex[:8]}"
    cluster().save(name)
    loaded = KubernetesCluster.load(name)
    assert "kubeconfig" in KubernetesCluster.model_json_schema()["secret_fields"]
    assert "BEGIN" not in repr(loaded) and "client-key-data" not in repr(loaded)
    assert loaded.kubeconfig.get_secret_value() == Path(k8s["KUBECONFIG"]).read_text()
    assert loaded.deploy(ServingSpec(service_name="digits", smoke_request=SMOKE), rel("1")).model_version == "1"
