"""The Kubernetes manifest builder, rollout assessment and smoke-test check (pure): golden files, GPU/MIG resources,
validation before any call. No cluster needed.

Regenerate the golden files after an intended change with GPUFERRY_UPDATE_GOLDEN=1.
"""

from __future__ import annotations


import pytest
from pydantic import ValidationError

from blocks import k8s_manifests as m
from blocks import k8s_rollout as r
from blocks.errors import ConfigurationError
from blocks.kubernetes import KubernetesCluster
from blocks.serving import Release
from blocks.specs import ImageRef, ServerSpec, ServingSpec
from tests.golden_files import GOLDEN, check_json

IMAGE = "registry.example.com/gpuferry/serve@sha256:" + "ab" * 32


def build(spec: ServingSpec, version: str = "3", image: str | None = IMAGE, **opts: object) -> dict:
    return m.build_manifests(
        spec, model_name="digits-mlp", version=version, model_uri="s3://models/digits/v3", image=image,
        opts=m.options(**opts),
    )  # fmt: skip


def check_golden(name: str, obj: object) -> None:
    check_json(GOLDEN / f"{name}.json", obj)


def env_of(deployment: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_golden_mig_deployment_with_hpa_and_pdb() -> None:
    spec = ServingSpec(service_name="digits", replicas=2, mig_profile="1g.10gb", max_batch_size=32)
    objs = build(spec, namespace="serving", node_selector={"nvidia.com/gpu.present": "true"},
                 autoscale_max_replicas=6, pdb_min_available=1, hpa_api_version="autoscaling/v2beta2",
                 pdb_api_version="policy/v1beta1")  # fmt: skip
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


READER_ENV = {"AWS_ENDPOINT_URL": "https://s3.example.org", "AWS_ACCESS_KEY_ID": "AKIA-planted",
              "AWS_SECRET_ACCESS_KEY": "planted-secret-key", "AWS_CA_BUNDLE": "/home/alice/ca.pem"}  # fmt: skip


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
        "AWS_ACCESS_KEY_ID": "AKIA-planted", "AWS_SECRET_ACCESS_KEY": "planted-secret-key"}  # fmt: skip
    assert m.store_secret(spec, {"AWS_CA_BUNDLE": "/ca.pem"}, opts) is None

    dep = m.build_manifests(spec, model_name="digits-mlp", version="3", model_uri="s3://models/digits/v3",
                            image=IMAGE, opts=opts, store_secret=("digits-mlp-model-store", "4711"))["deployment"]  # fmt: skip
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

    objs = m.build_manifests(spec, model_name="digits-mlp", version="3", model_uri="s3://models/digits/v3",
                             image=IMAGE, opts=opts, store_secret=("digits-model-store", "4711"),
                             store_keys=sorted(secret["data"]))  # fmt: skip
    check_golden("k8s_store_ca", objs)
    template = objs["deployment"]["spec"]["template"]
    container = template["spec"]["containers"][0]
    # envFrom would make the certificate a variable too: the variables are taken key by key instead.
    assert "envFrom" not in container
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {k: {"name": "digits-model-store", "key": k, "optional": True}
                    for k in ("AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY")}  # fmt: skip
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert values["AWS_CA_BUNDLE"] == m.STORE_CA_PATH == f"{m.STORE_CA_DIR}/{m.STORE_CA_KEY}"
    # The certificate, and only it, is a read-only file at that path; the host mount stays.
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["store-ca"]["secret"] == {"secretName": "digits-model-store", "optional": True,
                                             "items": [{"key": m.STORE_CA_KEY, "path": m.STORE_CA_KEY}]}  # fmt: skip
    assert {"name": "store-ca", "mountPath": m.STORE_CA_DIR, "readOnly": True} in container["volumeMounts"]
    assert {"name": "host-0", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    # A rotated certificate is a changed Secret, whose new resourceVersion rolls the pods.
    assert template["metadata"]["annotations"][m.STORE_SECRET_ANNOTATION] == "4711"
    assert "MIIBplanted" not in str(objs) and "planted-secret-key" not in str(objs)


def test_the_ca_is_read_from_the_path_the_store_names_here(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pydantic import SecretStr

    from blocks.k8s_secrets import store_secret_for

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
    dep = m.build_manifests(ServingSpec(service_name="digits"), model_name="digits-mlp", version="3",
                            model_uri="s3://models/digits/v3", image=IMAGE, opts=opts,
                            store_secret=("digits-model-store", "1"))["deployment"]  # fmt: skip
    template = dep["spec"]["template"]
    assert template["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "model-store"}}]
    assert m.STORE_SECRET_ANNOTATION not in template["metadata"]["annotations"]
    assert "envFrom" not in build(ServingSpec(service_name="digits"))["deployment"]["spec"]["template"]["spec"]["containers"][0]


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
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "digits", "app.kubernetes.io/instance": "digits"}  # fmt: skip
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_the_workloads_own_server_brings_its_command_port_and_probes() -> None:
    server = ServerSpec(command=["python", "serve.py", "--fast"], port=9000, health_path="/live",
                        readiness_path="/ready", prediction_path="/v1/predict", env={"MODE": "prod"},
                        workdir="/workload")  # fmt: skip
    dep = m.build_manifests(ServingSpec(service_name="house"), model_name="house", version="2", model_uri="s3://m/2",
                            image=IMAGE, opts=m.options(), server=server, checkpoint_sha256="c" * 64)["deployment"]  # fmt: skip
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "serve.py", "--fast"] and container["workingDir"] == "/workload"
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == "/live"
    env = env_of(dep)
    assert env["PORT"] == "9000" and env["MODE"] == "prod" and env["MODEL_SHA256"] == "c" * 64
    mlflow = build(ServingSpec(service_name="digits"))["deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert mlflow["command"] == ["python", "-m", "runtime.serve"] and "workingDir" not in mlflow


def test_hpa_owns_replicas() -> None:
    dep = build(ServingSpec(service_name="digits", replicas=2), autoscale_max_replicas=4)["deployment"]
    assert "replicas" not in dep["spec"]


def test_no_image_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="Kubernetes needs an image"):
        build(ServingSpec(service_name="digits"), image=None)


def test_image_must_be_pinned_by_digest() -> None:
    with pytest.raises(ConfigurationError, match="not pinned by digest"):
        build(ServingSpec(service_name="digits"), image="registry.example.com/gpuferry/serve:latest")


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown manifest option\(s\) gpu_resouce; valid: .*gpu_resource"):
        m.options(gpu_resouce="nvidia.com/gpu")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("memory_limit", "2 GB", "memory_limit"), ("namespace", "Serving", "namespace"),
     ("gpu_resource", "gpu", "gpu_resource"), ("host_path_mounts", {"models": "/models"}, "absolute")],
)  # fmt: skip
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
        block.validate(ServingSpec.model_construct(**{**ServingSpec(service_name="digits").model_dump(), "mig_profile": "1g.10g"}))
    with pytest.raises(ConfigurationError, match="autoscale_max_replicas=1 is below replicas=2"):
        KubernetesCluster(autoscale_max_replicas=1).validate(ServingSpec(service_name="digits", replicas=2))
    with pytest.raises(ConfigurationError, match="memory_request"):
        KubernetesCluster(memory_request="lots").validate(ServingSpec(service_name="digits"))


def test_deploy_without_image_fails_before_any_call() -> None:
    block = KubernetesCluster()  # in-cluster config is not available here: a call would fail differently
    release = Release(model_name="digits-mlp", version="1", model_uri="s3://m/1",
                      image=ImageRef(builder="current-environment", content_tag="x"))  # fmt: skip
    with pytest.raises(ConfigurationError, match="Kubernetes needs an image"):
        block.deploy(ServingSpec(service_name="digits"), release)


def test_service_name_must_fit_a_dns_label() -> None:
    with pytest.raises(ConfigurationError, match="service_name='-x'|cannot be a Kubernetes object name"):
        m.service_object_name(ServingSpec.model_construct(service_name="-x"))
    assert m.service_object_name(ServingSpec(service_name="Digits_v2")) == "digits-v2"


# ---- rollout assessment --------------------------------------------------------------------------


def _dep(generation: int = 2, observed: int = 2, replicas: int = 2, updated: int = 2, available: int = 2,
         total: int | None = None, revision: str = "2", conditions: list | None = None) -> dict:  # fmt: skip
    return {
        "metadata": {"name": "digits", "namespace": "default", "uid": "dep", "generation": generation,
                     "annotations": {r.REVISION_ANNOTATION: revision}},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": observed, "replicas": updated if total is None else total,
                   "updatedReplicas": updated, "availableReplicas": available, "conditions": conditions or []},
    }  # fmt: skip


def _rs(uid: str, revision: str) -> dict:
    return {"metadata": {"uid": uid, "name": f"digits-{uid}", "ownerReferences": [{"uid": "dep"}],
                         "annotations": {r.REVISION_ANNOTATION: revision}},
            "spec": {"template": {"metadata": {}, "spec": {}}}}  # fmt: skip


def _pod(owner: str, waiting: str | None = None, last: dict | None = None) -> dict:
    status = {"image": IMAGE, "state": {"waiting": {"reason": waiting, "message": "boom"}} if waiting else {"running": {}}}
    if last:
        status["lastState"] = {"terminated": last}
    return {"metadata": {"name": f"p-{owner}", "ownerReferences": [{"uid": owner}]},
            "status": {"phase": "Pending", "containerStatuses": [status]}}  # fmt: skip


RSS = [_rs("rs1", "1"), _rs("rs2", "2")]


def test_rollout_done_and_progressing() -> None:
    assert r.assess(_dep(), RSS, [_pod("rs2")]).phase == "done"
    assert r.assess(_dep(observed=1), RSS, []).message.startswith("waiting for the controller")
    assert r.assess(_dep(updated=1, available=1), RSS, []).phase == "progressing"
    assert "old replicas" in r.assess(_dep(total=3), RSS, []).message
    assert r.assess(_dep(available=1), RSS, []).phase == "progressing"


@pytest.mark.parametrize(
    ("waiting", "last", "reason", "hint"),
    [("ImagePullBackOff", None, "ImagePullBackOff", "cannot pull image"),
     ("CrashLoopBackOff", {"exitCode": 3, "reason": "Error"}, "CrashLoopBackOff", "exit code 3"),
     (None, {"exitCode": 137, "reason": "OOMKilled"}, "OOMKilled", "raise memory_limit"),
     ("CreateContainerConfigError", None, "CreateContainerConfigError", "Secret or ConfigMap")],
)  # fmt: skip
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
        return [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                 "message": f'ReplicaSet "digits-{rs}" has timed out progressing.'}]  # fmt: skip

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
    assert set(m.ManifestOptions.model_fields) - set(KubernetesCluster.model_fields) == {"hpa_api_version", "pdb_api_version"}


# ---- the smoke test's check and its pod-proxy transport (no cluster: the transport is replaced) ----------


def _ready(name: str = "digits-abc-1") -> r.RolloutState:
    return r.RolloutState("done", "2 of 2 replicas available", pods=[{"name": name, "ready": True, "detail": ""}])


SMOKE = {"inputs": [[0.0] * 64, [1.0] * 64]}


def _release(server: ServerSpec | None = None) -> Release:
    return Release(model_name="digits-mlp", version="2", model_uri="s3://m/2", server=server or ServerSpec(),
                   image=ImageRef(builder="docker", content_tag="x", reference="r/w@sha256:" + "a" * 64))  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "match"),
    [((200, {"predictions": [[0.1, 0.9], [0.8, 0.2]]}), None),
     ((422, {"error": "has 3 values; expected 64"}), "answered 422: .*expected 64"),
     ((503, "upstream connect error"), "answered 503: upstream connect error"),
     ((200, {"predictions": [1]}), "sent 2 rows, got 1 predictions"),
     ((200, "not json"), "the answer has no predictions: not json")],
)  # fmt: skip
def test_smoke_check_through_a_transport(answer: tuple[int, object], match: str | None) -> None:
    from blocks.errors import DeployFailed
    from blocks.serving import smoke_check

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
    from blocks.serving import smoke_check

    own = ServerSpec(command=["python", "serve.py"], prediction_path="/v1/predict")
    sent: list[str] = []

    def send(path: str, body: dict) -> tuple[int, object]:
        sent.append(path)
        return 200, {"label": 3}  # not MLflow's answer shape: its own server answers as it likes

    assert smoke_check(send, own, SMOKE) == {"label": 3} and sent == ["/v1/predict"]


def test_smoke_test_on_kubernetes_names_the_pod_and_fails_on_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from blocks.errors import DeployFailed

    block = KubernetesCluster()
    spec = ServingSpec(smoke_request=SMOKE)
    calls: list[tuple[str, str, object, int | None]] = []

    def answer(self: KubernetesCluster, pod: str, path: str, body: object = None,
               port: int | None = None) -> tuple[int, object]:  # fmt: skip
        calls.append((pod, path, body, port))
        return 422, {"error": "bad input"}

    monkeypatch.setattr(KubernetesCluster, "pod_request", answer)
    with pytest.raises(DeployFailed, match=r"pod digits-abc-1: smoke test: /invocations answered 422"):
        block._smoke_test(spec, _release(), _ready())
    assert calls == [("digits-abc-1", "/invocations", SMOKE, block.container_port)]
    own = ServerSpec(command=["python", "serve.py"], port=9000, prediction_path="/v1/predict")
    with pytest.raises(DeployFailed, match=r"/v1/predict answered 422"):
        block._smoke_test(spec, _release(own), _ready())
    assert calls[-1] == ("digits-abc-1", "/v1/predict", SMOKE, 9000)  # the workload server's own port

    def hang(self: KubernetesCluster, pod: str, path: str, body: object = None,
             port: int | None = None) -> tuple[int, object]:  # fmt: skip
        raise httpx.ReadTimeout("timed out")

    monkeypatch.setattr(KubernetesCluster, "pod_request", hang)
    with pytest.raises(DeployFailed, match="pod digits-abc-1: smoke test: no answer .*ReadTimeout"):
        block._smoke_test(spec, _release(), _ready())
    with pytest.raises(DeployFailed, match="no ready pod of the new ReplicaSet"):
        block._smoke_test(spec, _release(), r.RolloutState("done", "", pods=[{"name": "x", "ready": False}]))


def test_a_kubeconfig_with_a_token_sends_it() -> None:
    """A token user (a ServiceAccount's, or what an exec plugin such as EKS's or GKE's returns) is a Bearer header;
    tests/test_check.py uses one against the local cluster."""
    from blocks.k8s_api import connection_from_kubeconfig

    config = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://k8s.example.org:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc.def}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: models}}]
current-context: x
"""
    conn = connection_from_kubeconfig(config)
    assert conn.headers == {"Authorization": "Bearer abc.def"}
    assert conn.server == "https://k8s.example.org:6443" and conn.namespace == "models"
