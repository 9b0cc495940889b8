"""The Kubernetes manifest builder, rollout assessment and smoke-test check (pure): golden files, GPU/MIG resources,
validation before any call; and the API client's retry policy and errors against a scripted fake API server on
loopback. No cluster needed.

Regenerate the golden files after an intended change with GPUFERRY_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest
from pydantic import ValidationError

from blocks.base.serving import Release
from blocks.errors import ConfigurationError
from blocks.kubernetes import manifests as m
from blocks.kubernetes import rollout as r
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.records import ImageRef, ServerSpec
from blocks.specs import ServingSpec
from tests.golden_files import GOLDEN, check_json

IMAGE = "registry.example.com/gpuferry/serve@sha256:" + "ab" * 32


def build(spec: ServingSpec, version: str = "3", image: str | None = IMAGE, **opts: object) -> dict:
    return m.build_manifests(
        spec,
        model_name="digits-mlp",
        version=version,
        model_uri="s3://models/digits/v3",
        image=image,
        opts=m.options(**opts),
    )


def check_golden(name: str, obj: object) -> None:
    check_json(GOLDEN / f"{name}.json", obj)


def env_of(deployment: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_golden_mig_deployment_with_hpa_and_pdb() -> None:
    spec = ServingSpec(service_name="digits", replicas=2, mig_profile="1g.10gb", max_batch_size=32)
    objs = build(
        spec,
        namespace="serving",
        node_selector={"nvidia.com/gpu.present": "true"},
        autoscale_max_replicas=6,
        pdb_min_available=1,
        hpa_api_version="autoscaling/v2beta2",
        pdb_api_version="policy/v1beta1",
    )
    assert set(objs) == {"deployment", "service", "hpa", "pdb"}
    check_golden("k8s_mig_hpa_pdb", objs)


def test_golden_cpu_deployment() -> None:
    check_golden("k8s_cpu", build(ServingSpec(service_name="digits")))


def test_whole_gpus_limits_toleration_and_env() -> None:
    spec = ServingSpec(service_name="digits", replicas=3, gpus=2, max_batch_wait_ms=1.5, max_queue=100)
    dep = build(spec)["deployment"]
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["image"] == IMAGE
    assert dep["spec"]["replicas"] == 3
    env = env_of(dep)
    assert env["MODEL_URI"] == "s3://models/digits/v3"
    assert env["MAX_BATCH_WAIT_MS"] == "1.5" and env["MAX_QUEUE"] == "100" and env["PORT"] == "8080"
    assert "CUDA_VISIBLE_DEVICES" not in env  # only CPU replicas hide the GPUs


READER_ENV = {
    "AWS_ENDPOINT_URL": "https://s3.example.org",
    "AWS_ACCESS_KEY_ID": "AKIA-planted",
    "AWS_SECRET_ACCESS_KEY": "planted-secret-key",
    "AWS_CA_BUNDLE": "/home/alice/ca.pem",
}


def test_the_stores_secret_holds_the_readers_variables_and_the_pods_read_it() -> None:
    import base64

    spec = ServingSpec(service_name="Digits_MLP")
    opts = m.options(namespace="serving", env={"AWS_ENDPOINT_URL": "http://10.0.0.5:9000"})
    secret = m.store_secret(spec, READER_ENV, opts)
    assert secret is not None and secret["metadata"]["name"] == m.store_secret_name(spec) == "digits-mlp-model-store"
    assert secret["metadata"]["namespace"] == "serving" and m.is_ours(secret)
    assert secret["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuferry"
    # The block's env wins over the Secret (the endpoint as the pods reach it); a path of this machine's stays out.
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "AWS_ACCESS_KEY_ID": "AKIA-planted",
        "AWS_SECRET_ACCESS_KEY": "planted-secret-key",
    }
    assert m.store_secret(spec, {"AWS_CA_BUNDLE": "/ca.pem"}, opts) is None

    dep = m.build_manifests(
        spec,
        model_name="digits-mlp",
        version="3",
        model_uri="s3://models/digits/v3",
        image=IMAGE,
        opts=opts,
        store_secret=("digits-mlp-model-store", "4711"),
    )["deployment"]
    template = dep["spec"]["template"]
    assert template["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "digits-mlp-model-store"}}]
    assert template["metadata"]["annotations"][m.STORE_SECRET_ANNOTATION] == "4711"  # a changed Secret restarts pods
    assert "planted-secret-key" not in str(dep) and "AKIA-planted" not in str(dep)


PEM = b"-----BEGIN CERTIFICATE-----\nMIIBplanted\n-----END CERTIFICATE-----\n"


def test_the_stores_ca_goes_into_its_secret_and_the_pods_read_it_as_a_file() -> None:
    import base64

    spec = ServingSpec(service_name="digits")
    opts = m.options(host_path_mounts={"/srv/models": "/models"})
    secret = m.store_secret(spec, READER_ENV, opts, ca_bundle=PEM)
    assert secret is not None and base64.b64decode(secret["data"][m.STORE_CA_KEY]) == PEM
    assert "AWS_CA_BUNDLE" not in secret["data"]  # the path of this machine's stays out
    assert m.store_secret(spec, {}, opts, ca_bundle=PEM)["data"].keys() == {m.STORE_CA_KEY}  # type: ignore[index]
    # A block env that gives the pods their own AWS_CA_BUNDLE keeps the certificate out.
    own = m.options(env={"AWS_CA_BUNDLE": "/etc/ssl/corp.pem"})
    assert m.STORE_CA_KEY not in m.store_secret(spec, READER_ENV, own, ca_bundle=PEM)["data"]  # type: ignore[index]

    objs = m.build_manifests(
        spec,
        model_name="digits-mlp",
        version="3",
        model_uri="s3://models/digits/v3",
        image=IMAGE,
        opts=opts,
        store_secret=("digits-model-store", "4711"),
        store_keys=sorted(secret["data"]),
    )
    check_golden("k8s_store_ca", objs)
    template = objs["deployment"]["spec"]["template"]
    container = template["spec"]["containers"][0]
    # envFrom would make the certificate a variable too: the variables are taken key by key instead.
    assert "envFrom" not in container
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {
        k: {"name": "digits-model-store", "key": k, "optional": True}
        for k in ("AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY")
    }
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert values["AWS_CA_BUNDLE"] == m.STORE_CA_PATH == f"{m.STORE_CA_DIR}/{m.STORE_CA_KEY}"
    # The certificate, and only it, is a read-only file at that path; the host mount stays.
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["store-ca"]["secret"] == {
        "secretName": "digits-model-store",
        "optional": True,
        "items": [{"key": m.STORE_CA_KEY, "path": m.STORE_CA_KEY}],
    }
    assert {"name": "store-ca", "mountPath": m.STORE_CA_DIR, "readOnly": True} in container["volumeMounts"]
    assert {"name": "host-0", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    # A rotated certificate is a changed Secret, whose new resourceVersion rolls the pods.
    assert template["metadata"]["annotations"][m.STORE_SECRET_ANNOTATION] == "4711"
    assert "MIIBplanted" not in str(objs) and "planted-secret-key" not in str(objs)


def test_the_ca_is_read_from_the_path_the_store_names_here(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pydantic import SecretStr

    from blocks.kubernetes.secrets import store_secret_for

    spec, opts = ServingSpec(service_name="digits"), m.options()
    ca = tmp_path / "ca.pem"
    ca.write_bytes(PEM)
    env = {k: SecretStr(v) for k, v in {**READER_ENV, "AWS_CA_BUNDLE": str(ca)}.items()}
    secret = store_secret_for(spec, env, opts)
    assert secret is not None and secret == m.store_secret(spec, READER_ENV, opts, ca_bundle=PEM)
    with pytest.raises(ConfigurationError, match=r"verify_cert_path \(/nonexistent/ca.pem\).*cannot be read here"):
        store_secret_for(spec, {**env, "AWS_CA_BUNDLE": SecretStr("/nonexistent/ca.pem")}, opts)
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(ConfigurationError, match="verify_cert_path .* holds no PEM certificate"):
        store_secret_for(spec, {**env, "AWS_CA_BUNDLE": SecretStr(str(tmp_path / "key.pem"))}, opts)
    # The block's env names the pods' own CA: this machine's file is not read at all.
    own = m.options(env={"AWS_CA_BUNDLE": "/etc/ssl/corp.pem"})
    assert store_secret_for(spec, {**env, "AWS_CA_BUNDLE": SecretStr("/nonexistent/ca.pem")}, own) is not None
    assert store_secret_for(spec, {}, opts) is None


def test_env_from_secret_wins_over_the_stores_secret() -> None:
    opts = m.options(env_from_secret="model-store")
    dep = m.build_manifests(
        ServingSpec(service_name="digits"),
        model_name="digits-mlp",
        version="3",
        model_uri="s3://models/digits/v3",
        image=IMAGE,
        opts=opts,
        store_secret=("digits-model-store", "1"),
    )["deployment"]
    template = dep["spec"]["template"]
    assert template["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "model-store"}}]
    assert m.STORE_SECRET_ANNOTATION not in template["metadata"]["annotations"]
    assert (
        "envFrom"
        not in build(ServingSpec(service_name="digits"))["deployment"]["spec"]["template"]["spec"]["containers"][0]
    )


def test_time_sliced_resource_name() -> None:
    dep = build(ServingSpec(service_name="digits", gpus=1), gpu_resource="nvidia.com/gpu.shared")["deployment"]
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu.shared"] == "1" and "nvidia.com/gpu" not in limits


def test_mig_profile_resource() -> None:
    dep = build(ServingSpec(service_name="digits", mig_profile="3g.40gb"))["deployment"]
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "2Gi", "nvidia.com/mig-3g.40gb": "1"}


def test_probes_labels_annotations_and_service() -> None:
    objs = build(ServingSpec(service_name="digits", ready_timeout_seconds=90), version="7")
    dep, svc = objs["deployment"], objs["service"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 90
    template_meta = dep["spec"]["template"]["metadata"]
    assert template_meta["labels"]["app.kubernetes.io/version"] == "7"
    assert template_meta["annotations"][m.MODEL_VERSION_ANNOTATION] == "7"
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "7"
    # The selector never carries the version (it is immutable); the Service selects all versions.
    assert (
        dep["spec"]["selector"]["matchLabels"]
        == svc["spec"]["selector"]
        == {"app.kubernetes.io/name": "digits", "app.kubernetes.io/instance": "digits"}
    )
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_the_workloads_own_server_brings_its_command_port_and_probes() -> None:
    server = ServerSpec(
        command=["python", "serve.py", "--fast"],
        port=9000,
        health_path="/live",
        readiness_path="/ready",
        prediction_path="/v1/predict",
        env={"MODE": "prod"},
        workdir="/workload",
    )
    dep = m.build_manifests(
        ServingSpec(service_name="house"),
        model_name="house",
        version="2",
        model_uri="s3://m/2",
        image=IMAGE,
        opts=m.options(),
        server=server,
        checkpoint_sha256="c" * 64,
    )["deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "serve.py", "--fast"] and container["workingDir"] == "/workload"
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == "/live"
    env = env_of(dep)
    assert env["PORT"] == "9000" and env["MODE"] == "prod" and env["MODEL_SHA256"] == "c" * 64
    mlflow = build(ServingSpec(service_name="digits"))["deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert mlflow["command"] == ["python", "/opt/gpuferry/runtime/serve.py"] and "workingDir" not in mlflow


def test_hpa_owns_replicas() -> None:
    dep = build(ServingSpec(service_name="digits", replicas=2), autoscale_max_replicas=4)["deployment"]
    assert "replicas" not in dep["spec"]


def test_no_image_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="KubernetesCluster needs an image"):
        build(ServingSpec(service_name="digits"), image=None)


def test_image_must_be_pinned_by_digest() -> None:
    with pytest.raises(ConfigurationError, match="not pinned by digest"):
        build(ServingSpec(service_name="digits"), image="registry.example.com/gpuferry/serve:latest")


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown manifest option\(s\) gpu_resouce; valid: .*gpu_resource"):
        m.options(gpu_resouce="nvidia.com/gpu")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("memory_limit", "2 GB", "memory_limit"),
        ("namespace", "Serving", "namespace"),
        ("gpu_resource", "gpu", "gpu_resource"),
        ("host_path_mounts", {"models": "/models"}, "absolute"),
    ],
)
def test_bad_options_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        m.options(**{field: value})


def test_mig_profile_typo_rejected_by_the_spec() -> None:
    with pytest.raises(ValidationError, match="1g.10g' is not a MIG profile"):
        ServingSpec(mig_profile="1g.10g")


def test_block_validate_rejects_bad_input_without_a_cluster() -> None:
    # No kubeconfig and not in a pod: any API call would fail; validate makes none.
    block = KubernetesCluster(memory_limit="2Gi")
    block.validate(ServingSpec(service_name="digits", mig_profile="1g.10gb"))
    with pytest.raises(ConfigurationError, match="not a MIG profile"):
        block.validate(
            ServingSpec.model_construct(**{**ServingSpec(service_name="digits").model_dump(), "mig_profile": "1g.10g"})
        )
    with pytest.raises(ConfigurationError, match="autoscale_max_replicas=1 is below replicas=2"):
        KubernetesCluster(autoscale_max_replicas=1).validate(ServingSpec(service_name="digits", replicas=2))
    with pytest.raises(ConfigurationError, match="memory_request"):
        KubernetesCluster(memory_request="lots").validate(ServingSpec(service_name="digits"))


def test_deploy_without_image_fails_before_any_call() -> None:
    block = KubernetesCluster()  # in-cluster config is not available here: a call would fail differently
    release = Release(
        model_name="digits-mlp",
        version="1",
        model_uri="s3://m/1",
        image=ImageRef(builder="current-environment", content_tag="x"),
    )
    with pytest.raises(ConfigurationError, match="KubernetesCluster needs an image"):
        block.deploy(ServingSpec(service_name="digits"), release)


def test_service_name_must_fit_a_dns_label() -> None:
    with pytest.raises(ConfigurationError, match="service_name='-x'|cannot be a Kubernetes object name"):
        m.service_object_name(ServingSpec.model_construct(service_name="-x"))
    assert m.service_object_name(ServingSpec(service_name="Digits_v2")) == "digits-v2"


# ---- rollout assessment --------------------------------------------------------------------------


def _dep(
    generation: int = 2,
    observed: int = 2,
    replicas: int = 2,
    updated: int = 2,
    available: int = 2,
    total: int | None = None,
    revision: str = "2",
    conditions: list | None = None,
) -> dict:
    return {
        "metadata": {
            "name": "digits",
            "namespace": "default",
            "uid": "dep",
            "generation": generation,
            "annotations": {r.REVISION_ANNOTATION: revision},
        },
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": updated if total is None else total,
            "updatedReplicas": updated,
            "availableReplicas": available,
            "conditions": conditions or [],
        },
    }


def _rs(uid: str, revision: str) -> dict:
    return {
        "metadata": {
            "uid": uid,
            "name": f"digits-{uid}",
            "ownerReferences": [{"uid": "dep"}],
            "annotations": {r.REVISION_ANNOTATION: revision},
        },
        "spec": {"template": {"metadata": {}, "spec": {}}},
    }


def _pod(owner: str, waiting: str | None = None, last: dict | None = None) -> dict:
    status = {
        "image": IMAGE,
        "state": {"waiting": {"reason": waiting, "message": "boom"}} if waiting else {"running": {}},
    }
    if last:
        status["lastState"] = {"terminated": last}
    return {
        "metadata": {"name": f"p-{owner}", "ownerReferences": [{"uid": owner}]},
        "status": {"phase": "Pending", "containerStatuses": [status]},
    }


RSS = [_rs("rs1", "1"), _rs("rs2", "2")]


def test_rollout_done_and_progressing() -> None:
    assert r.assess(_dep(), RSS, [_pod("rs2")]).phase == "done"
    assert r.assess(_dep(observed=1), RSS, []).message.startswith("waiting for the controller")
    assert r.assess(_dep(updated=1, available=1), RSS, []).phase == "progressing"
    assert "old replicas" in r.assess(_dep(total=3), RSS, []).message
    assert r.assess(_dep(available=1), RSS, []).phase == "progressing"


@pytest.mark.parametrize(
    ("waiting", "last", "reason", "hint"),
    [
        ("ImagePullBackOff", None, "ImagePullBackOff", "cannot pull image"),
        ("CrashLoopBackOff", {"exitCode": 3, "reason": "Error"}, "CrashLoopBackOff", "exit code 3"),
        (None, {"exitCode": 137, "reason": "OOMKilled"}, "OOMKilled", "raise memory_limit"),
        ("CreateContainerConfigError", None, "CreateContainerConfigError", "Secret or ConfigMap"),
    ],
)
def test_pod_reasons_fail_the_rollout(waiting: str | None, last: dict | None, reason: str, hint: str) -> None:
    state = r.assess(_dep(updated=1, available=0), RSS, [_pod("rs2", waiting, last)])
    assert state.phase == "failed" and state.reason == reason and hint in state.message


def test_old_pods_problems_do_not_fail_the_new_rollout() -> None:
    assert r.assess(_dep(), RSS, [_pod("rs1", "CrashLoopBackOff"), _pod("rs2")]).phase == "done"


def test_err_image_pull_waits_for_the_backoff() -> None:
    assert r.assess(_dep(updated=1, available=0), RSS, [_pod("rs2", "ErrImagePull")]).phase == "progressing"


def test_progress_deadline_exceeded() -> None:
    cond = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}]
    state = r.assess(_dep(updated=1, available=0, conditions=cond), RSS, [])
    assert state.phase == "failed" and state.reason == "ProgressDeadlineExceeded"


def test_a_deadline_of_the_rolled_back_replicaset_is_not_the_rollbacks_failure() -> None:
    """Rolled back to rs1, the controller still shows rs2's exceeded deadline until it sees progress: the
    rollback is progressing, not failed. A deadline naming the current ReplicaSet fails it."""

    def deadline(rs: str) -> list:
        return [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": f'ReplicaSet "digits-{rs}" has timed out progressing.',
            }
        ]

    back = _dep(revision="3", updated=1, available=1, total=2, conditions=deadline("rs2"))
    rss = [_rs("rs1", "3"), _rs("rs2", "2")]
    assert r.assess(back, rss, [_pod("rs1")]).phase == "progressing"
    failed = r.assess(_dep(revision="3", updated=1, available=0, conditions=deadline("rs1")), rss, [])
    assert failed.phase == "failed" and failed.reason == "ProgressDeadlineExceeded"


def test_previous_replicaset() -> None:
    assert r.previous_replicaset(_dep(revision="2"), RSS)["metadata"]["uid"] == "rs1"
    assert r.previous_replicaset(_dep(revision="1"), RSS) is None


def test_watch_times_out_with_the_last_state() -> None:
    state = r.watch(lambda: (_dep(updated=0, available=0), RSS, []), timeout=0.3, first_interval=0.05)
    assert state.phase == "failed" and state.reason == "Timeout" and "0 of 2 replicas updated" in state.message


def test_every_block_field_is_described_for_the_ui() -> None:
    missing = [n for n, f in KubernetesCluster.model_fields.items() if not f.description]
    assert not missing, f"fields without description=: {missing}"
    assert KubernetesCluster.model_json_schema()["secret_fields"] == ["kubeconfig"]
    # The manifest knobs the block exposes are exactly ManifestOptions' (the versions come from discovery).
    assert set(m.ManifestOptions.model_fields) - set(KubernetesCluster.model_fields) == {
        "hpa_api_version",
        "pdb_api_version",
    }


# ---- the smoke test's check and its pod-proxy transport (no cluster: the transport is replaced) ----------


def is_ready(name: str = "digits-abc-1") -> r.RolloutState:
    return r.RolloutState("done", "2 of 2 replicas available", pods=[{"name": name, "ready": True, "detail": ""}])


SMOKE = {"inputs": [[0.0] * 64, [1.0] * 64]}


def _release(server: ServerSpec | None = None) -> Release:
    return Release(
        model_name="digits-mlp",
        version="2",
        model_uri="s3://m/2",
        server=server or ServerSpec(),
        image=ImageRef(builder="docker", content_tag="x", reference="r/w@sha256:" + "a" * 64),
    )


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ((200, {"predictions": [[0.1, 0.9], [0.8, 0.2]]}), None),
        ((422, {"error": "has 3 values; expected 64"}), "answered 422: .*expected 64"),
        ((503, "upstream connect error"), "answered 503: upstream connect error"),
        ((200, {"predictions": [1]}), "sent 2 rows, got 1 predictions"),
        ((200, "not json"), "the answer has no predictions: not json"),
    ],
)
def test_smoke_check_through_a_transport(answer: tuple[int, object], match: str | None) -> None:
    from blocks.base.serving import smoke_check
    from blocks.errors import DeployFailed

    sent: list[tuple[str, dict]] = []

    def send(path: str, body: dict) -> tuple[int, object]:
        sent.append((path, body))
        return answer

    if match is None:
        assert smoke_check(send, ServerSpec(), SMOKE) == answer[1]
    else:
        with pytest.raises(DeployFailed, match=match):
            smoke_check(send, ServerSpec(), SMOKE)
    assert sent == [("/invocations", SMOKE)]


def test_a_workload_server_is_smoke_tested_on_its_own_path_and_only_for_a_200() -> None:
    from blocks.base.serving import smoke_check

    own = ServerSpec(command=["python", "serve.py"], prediction_path="/v1/predict")
    sent: list[str] = []

    def send(path: str, body: dict) -> tuple[int, object]:
        sent.append(path)
        return 200, {"label": 3}  # not MLflow's answer shape: its own server answers as it likes

    assert smoke_check(send, own, SMOKE) == {"label": 3} and sent == ["/v1/predict"]


def test_smoke_test_on_kubernetes_names_the_pod_and_fails_on_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from blocks.errors import DeployFailed
    from blocks.kubernetes.api import NoAnswer

    block = KubernetesCluster()
    spec = ServingSpec(smoke_request=SMOKE)
    calls: list[tuple[str, str, object, int | None]] = []

    def answer(
        self: KubernetesCluster, pod: str, path: str, body: object = None, port: int | None = None
    ) -> tuple[int, object]:
        calls.append((pod, path, body, port))
        return 422, {"error": "bad input"}

    monkeypatch.setattr(KubernetesCluster, "pod_request", answer)
    with pytest.raises(DeployFailed, match=r"pod digits-abc-1: smoke test: /invocations answered 422"):
        block._smoke_test(spec, _release(), is_ready())
    assert calls == [("digits-abc-1", "/invocations", SMOKE, block.container_port)]
    own = ServerSpec(command=["python", "serve.py"], port=9000, prediction_path="/v1/predict")
    with pytest.raises(DeployFailed, match=r"/v1/predict answered 422"):
        block._smoke_test(spec, _release(own), is_ready())
    assert calls[-1] == ("digits-abc-1", "/v1/predict", SMOKE, 9000)  # the workload server's own port

    def hang(
        self: KubernetesCluster, pod: str, path: str, body: object = None, port: int | None = None
    ) -> tuple[int, object]:
        raise NoAnswer(f"POST {path}", "ReadTimeoutError: timed out")

    monkeypatch.setattr(KubernetesCluster, "pod_request", hang)
    with pytest.raises(DeployFailed, match="pod digits-abc-1: smoke test: no answer .*ReadTimeout"):
        block._smoke_test(spec, _release(), is_ready())
    with pytest.raises(DeployFailed, match="no ready pod of the new ReplicaSet"):
        block._smoke_test(spec, _release(), r.RolloutState("done", "", pods=[{"name": "x", "ready": False}]))


class FakeApiServer:
    """A plain-HTTP API server on loopback that answers discovery (a 1.20 server's, cut to the kinds used here)
    and, per ``METHOD path``, a script of answers to give in turn: a status (with a ``Status`` body), a status and
    its message, or ``"hang"`` (no answer for 3 s).
    It records every request (method, path, headers by their lower-case names)."""

    RESOURCES: ClassVar[dict[str, list[dict[str, object]]]] = {
        "/api/v1": [
            {"name": "namespaces", "kind": "Namespace", "namespaced": False, "verbs": ["get", "create"]},
            {"name": "secrets", "kind": "Secret", "namespaced": True, "verbs": ["get", "create", "delete"]},
        ],
        "/apis/apps/v1": [
            {"name": "deployments", "kind": "Deployment", "namespaced": True, "verbs": ["get", "patch"]},
        ],
        "/apis/authorization.k8s.io/v1": [
            {"name": "selfsubjectaccessreviews", "kind": "SelfSubjectAccessReview", "namespaced": False},
        ],
    }

    def __init__(self) -> None:
        self.script: dict[str, list[int | str | tuple[int, str]]] = {}
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?", 1)[0]
                fake.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                planned = fake.script.get(f"{self.command} {path}")
                action = planned.pop(0) if planned else 200
                if action == "hang":
                    time.sleep(3)
                    self.close_connection = True
                    return
                status, message = action if isinstance(action, tuple) else (int(action), f"scripted {action}")
                body: dict[str, object] = {"kind": "Status", "message": message, "reason": "x"}
                if status == 200:
                    body = fake.discovery(path) or {"metadata": {"name": path.rsplit("/", 1)[-1]}}
                headers = {"Retry-After": "1"} if status == 429 else {}
                content = json.dumps(body).encode()
                self.send_response(status)
                for key, value in {**headers, "Content-Type": "application/json"}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any  # noqa: N815 - http.server's handler names

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def discovery(self, path: str) -> dict[str, object] | None:
        if path == "/version":
            return {"major": "1", "minor": "20", "gitVersion": "v1.20.2"}
        if path == "/apis":
            groups = []
            for name in ("apps", "authorization.k8s.io"):
                v1 = {"groupVersion": f"{name}/v1", "version": "v1"}
                groups.append({"name": name, "versions": [v1], "preferredVersion": v1})
            return {"kind": "APIGroupList", "groups": groups}
        if path in self.RESOURCES:
            return {"kind": "APIResourceList", "groupVersion": path.split("/", 2)[2], "resources": self.RESOURCES[path]}
        return None

    def calls(self, method: str, path: str) -> int:
        return sum(1 for m_, p, _ in self.seen if m_ == method and p.split("?", 1)[0] == path)

    def kubeconfig(self, user: str = "{}") -> str:
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: c, cluster: {{server: '{self.url}'}}}}]\n"
            f"users: [{{name: u, user: {user}}}]\n"
            "contexts: [{name: x, context: {cluster: c, user: u, namespace: models}}]\ncurrent-context: x\n"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def test_a_kubeconfig_with_a_token_sends_it(fake_api: FakeApiServer) -> None:
    """A token user (a ServiceAccount's, or what an exec plugin such as EKS's or GKE's returns) is a Bearer header
    on every request, discovery's too; tests/test_check.py uses one against the local cluster."""
    from blocks.kubernetes.api import KubeApi, connection_from_kubeconfig

    conn = connection_from_kubeconfig(fake_api.kubeconfig("{token: abc.def}"))
    assert conn.server == fake_api.url and conn.namespace == "models"
    api = KubeApi(conn, retries=0)
    assert api.read("v1", "Namespace", "models")["metadata"]["name"] == "models"
    api.close()
    assert [(m_, p) for m_, p, _ in fake_api.seen] == [
        ("GET", "/version"),
        ("GET", "/apis"),
        ("GET", "/api/v1"),
        ("GET", "/api/v1/namespaces/models"),
    ]
    assert {h.get("authorization") for _, _, h in fake_api.seen} == {"Bearer abc.def"}
    assert {h.get("user-agent") for _, _, h in fake_api.seen} == {"gpuferry"}


def test_transient_failures_are_retried_and_the_rest_are_not(fake_api: FakeApiServer) -> None:
    """The retry policy, request by request: 5xx, 429 and timeouts are retried on every method, up to ``retries``
    times; a 4xx, and the 500 of an object the server cannot merge, are answered at once."""
    from blocks.errors import TransientError
    from blocks.kubernetes.api import KubeApi, KubeApiError, NotFound, connection_from_kubeconfig

    api = KubeApi(connection_from_kubeconfig(fake_api.kubeconfig()), timeout=1.0, retries=3, backoff=0.01)
    ns = "/api/v1/namespaces/models"
    # Discovery is retried like any request.
    fake_api.script = {"GET /version": [503], "GET /apis": ["hang"]}
    assert api.read("v1", "Namespace", "models")["metadata"]["name"] == "models"
    assert (fake_api.calls("GET", "/version"), fake_api.calls("GET", "/apis")) == (2, 2)

    fake_api.script = {f"GET {ns}": [503, 502]}
    assert api.get(ns)["metadata"]["name"] == "models" and fake_api.calls("GET", ns) == 3 + 1
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "models"}}
    fake_api.script = {f"POST {ns}/secrets": [503, 504]}
    api.create(secret)
    assert fake_api.calls("POST", f"{ns}/secrets") == 3  # a create answers 409 when repeated: retried too

    fake_api.script = {f"GET {ns}": [429]}  # the server's Retry-After (1 s) is waited on top of the backoff
    start = time.monotonic()
    api.get(ns)
    assert time.monotonic() - start >= 1.0

    before = api.attempts
    fake_api.script = {f"GET {ns}": [404, 403, 422]}
    with pytest.raises(NotFound, match=f"GET {ns}: not found: scripted 404"):
        api.get(ns)
    assert api.get_or_none(ns + "x") is not None  # another path: not scripted
    with pytest.raises(KubeApiError, match="forbidden: scripted 403. Check the kubeconfig's user"):
        api.get(ns)
    with pytest.raises(KubeApiError, match="the API server rejected the object: scripted 422"):
        api.get(ns)
    assert api.attempts - before == 4

    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "models"}}
    path = "/apis/apps/v1/namespaces/models/deployments/d"
    fake_api.script = {f"PATCH {path}": [409]}
    with pytest.raises(KubeApiError, match=f"server-side apply conflict on {path}.*force_conflicts=true"):
        api.server_side_apply(dep, field_manager="gpuferry")
    assert fake_api.calls("PATCH", path) == 1

    fake_api.script = {f"GET {ns}": [503] * 4}
    with pytest.raises(TransientError, match=f"GET {fake_api.url}{ns} failed 4 times; last: HTTP 503: scripted 503"):
        api.get(ns)
    api.close()


def test_a_review_without_metadata_is_created(fake_api: FakeApiServer) -> None:
    """What the RBAC check sends: a SelfSubjectAccessReview, cluster-scoped and without metadata."""
    from blocks.kubernetes.api import KubeApi, connection_from_kubeconfig

    api = KubeApi(connection_from_kubeconfig(fake_api.kubeconfig()), retries=0)
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {}}
    api.create(review)
    assert fake_api.calls("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews") == 1
    api.close()


def test_an_object_the_server_cannot_merge_is_not_retried(fake_api: FakeApiServer) -> None:
    """A 1.20 server answers 500 "failed to create typed patch object" to an object it cannot merge (a Service
    port without its protocol): the same body fails again, so it is an error at once, which says so."""
    from blocks.kubernetes.api import KubeApi, KubeApiError, connection_from_kubeconfig

    api = KubeApi(connection_from_kubeconfig(fake_api.kubeconfig()), retries=3, backoff=0.01)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "models"}}
    path = "/apis/apps/v1/namespaces/models/deployments/d"
    fake_api.script = {f"PATCH {path}": [(500, "failed to create typed patch object: .spec.ports: element 0")]}
    with pytest.raises(KubeApiError, match=f"PATCH {path}: the API server cannot apply this object: failed to"):
        api.server_side_apply(dep, field_manager="gpuferry")
    assert fake_api.calls("PATCH", path) == 1
    api.close()


def test_a_request_through_the_pod_proxy_is_retried_only_when_the_api_server_is_unreachable(
    fake_api: FakeApiServer,
) -> None:
    """``proxy`` returns what the pod's server (or the API server for it) answered, whatever the status; an answer
    that does not come is ``NoAnswer`` at once (the request may have been served); only a connection the API server
    refused is retried."""
    from blocks.errors import TransientError
    from blocks.kubernetes.api import KubeApi, NoAnswer, connection_from_kubeconfig

    api = KubeApi(connection_from_kubeconfig(fake_api.kubeconfig()), retries=2, backoff=0.01)
    path = "/api/v1/namespaces/models/pods/p-1:8080/proxy/invocations"
    fake_api.script = {f"POST {path}": [503, "hang"]}
    assert api.proxy(path, {"inputs": [[0.0]]}) == (503, {"kind": "Status", "message": "scripted 503", "reason": "x"})
    with pytest.raises(NoAnswer, match=f"POST {fake_api.url}{path}: no answer .*ReadTimeoutError"):
        api.proxy(path, {"inputs": [[0.0]]}, timeout=1.0)
    assert fake_api.calls("POST", path) == 2
    assert fake_api.seen[0][2]["content-type"] == "application/json"
    api.close()

    fake_api.close()  # nothing listens there now
    api = KubeApi(connection_from_kubeconfig(fake_api.kubeconfig()), retries=2, backoff=0.01)
    with pytest.raises(TransientError, match=f"GET {fake_api.url}{path}: cannot reach the API server"):
        api.proxy(path)
    assert api.attempts == 3


def test_the_services_shape_sets_its_resources_autoscaling_gpus_and_device() -> None:
    """What the service's shape sets wins over the stack's options; what it leaves out is the stack's. A replica
    with a GPU (whole, time-sliced, MIG) runs the model on cuda; one without sees no GPU."""
    spec = ServingSpec(service_name="digits", replicas=2, max_replicas=6, gpus=1, cpu_request="3", memory_limit="6Gi")
    out = build(spec, cpu_request="250m", memory_request="512Mi", memory_limit="2Gi", autoscale_max_replicas=4)
    container = out["deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "3", "memory": "512Mi"},
        "limits": {"memory": "6Gi", "nvidia.com/gpu": "1"},
    }
    assert out["hpa"]["spec"]["minReplicas"] == 2 and out["hpa"]["spec"]["maxReplicas"] == 6
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MODEL_DEVICE"] == "cuda" and "CUDA_VISIBLE_DEVICES" not in env

    shared = build(ServingSpec(service_name="digits", share_gpus=True))["deployment"]["spec"]["template"]["spec"]
    assert shared["containers"][0]["resources"]["limits"]["nvidia.com/gpu.shared"] == "1"
    assert {"key": "nvidia.com/gpu.shared", "operator": "Exists", "effect": "NoSchedule"} in shared["tolerations"]

    cpu = build(ServingSpec(service_name="digits"))["deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in cpu["env"]}
    assert (env["MODEL_DEVICE"], env["CUDA_VISIBLE_DEVICES"], env["NVIDIA_VISIBLE_DEVICES"]) == ("cpu", "", "void")
    assert "hpa" not in build(ServingSpec(service_name="digits"))


def test_a_service_whose_pods_read_no_route_file_is_refused_a_canary_before_any_call() -> None:
    """Pods deployed by an older gpuferry (or running another server) cannot be given a share: the fix is named,
    and nothing is asked of the cluster (the block here has no cluster to reach)."""
    from blocks.base.serving import Release
    from blocks.errors import DeployFailed
    from blocks.kubernetes.cluster import KubernetesCluster
    from blocks.specs import RolloutPolicy

    spec = ServingSpec(
        service_name="digits", smoke_request={"inputs": [[0.0]]}, rollout=RolloutPolicy(strategy="canary", share=0.1)
    )
    objects = build(spec)
    serving = copy.deepcopy(objects["deployment"])
    container = serving["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "ROUTE_FILE"]
    with pytest.raises(DeployFailed, match="runs pods without a route file .* deploy once with serve.rollout"):
        KubernetesCluster()._judge(
            spec, Release(model_name="m", version="2", model_uri="s3://b/m"), objects, serving, 1
        )
