"""The retrain flow end to end on the real servers: Slurm trains, S3 holds, MLflow tracks, Kubernetes serves.

The stack, saved as a Prefect block and given to the flow by name: the workload image built with
podman and pushed to the registry stack (pinned by digest); training on the slurm stack over SSH, each
job pulling that image and running it with podman, and storing its model in the s3 stack itself (the
orchestrator does not read the cluster's filesystem); the MLflow server stack; serving on the local
Kubernetes cluster, whose node pulls the image with an image pull secret and runs it. The pod loads the
model from S3 by its MODEL_URI: the s3 stack listens on the host's loopback, which pods do not share, so
the test relays it from the node's address inside the node's network namespace (``s3_for_pods`` in
conftest.py). The digits MLP's pods get that endpoint and the credentials from a Secret of the test's own
(``env_from_secret``); the regressor's from the Secret the deploy makes of the store's credentials, the
endpoint as the pods reach it in the block's ``env``. The test reaches the pod through the API server's pod
proxy.

Both examples go this way. For the digits MLP, a first retrain serves v1; a second one whose server cannot
start rolls back to v1, fails the flow, and MLflow says so on the run and on the model version; v2, made champion
and served, is rolled back with `gpuferry rollback` (v1 with its shape, the alias with it). The
regressor is served and answers its own input example's columns.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prefect.artifacts import Artifact
from prefect.settings import PREFECT_API_URL
from pydantic import SecretStr

from blocks.base.provider import ClusterManaged
from blocks.docker.image import DockerImageBuilder
from blocks.errors import ConfigurationError, RolledBack
from blocks.kubernetes import manifests as m
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources, ServingSpec, TrainingSpec
from blocks.stack import Stack
from blocks.storage.s3 import S3CheckpointStore
from blocks.tracking.mlflow import MlflowTracking
from flows.deploy_model import deploy_model
from flows.retrain import retrain
from tests.examples import DIABETES, DIGITS, example_module
from tests.k8s_node import PULL_SECRET, ready_pods
from tests.stacks import mlflow_server, stack_env

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parent.parent
SECRET = "model-store"  # the Secret holding the pod's S3 endpoint and credentials


def serving_block(k8s: dict[str, str], namespace: str, **fields: Any) -> KubernetesCluster:
    fields = {
        "rollout_timeout_seconds": 400,
        "cpu_request": "10m",
        "memory_request": "64Mi",
        "env_from_secret": SECRET,
        "image_pull_secret": PULL_SECRET,
        **fields,
    }
    return KubernetesCluster(kubeconfig=SecretStr(Path(k8s["KUBECONFIG"]).read_text()), namespace=namespace, **fields)


# What a job asks of the slurm stack's nodes (the workloads' own defaults are for real GPU nodes).
RESOURCES = Resources(gpus_per_node=1, mem_gb=2, time_limit_minutes=20)


def save_stack(
    serving: KubernetesCluster, images: Any, compute: SlurmCluster, storage: Any, tracking: MlflowTracking
) -> str:
    name = f"k8s-pipeline-{uuid.uuid4().hex[:8]}"
    Stack(
        provider=ClusterManaged(cluster_name="gpuferry-test"),
        images=images,
        compute=compute,
        storage=storage,
        tracking=tracking,
        serving=serving,
    ).save(name)
    return name


def with_store_secret(block: KubernetesCluster, namespace: str, s3_for_pods: dict[str, str]) -> None:
    block._api().request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        body={"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "stringData": s3_for_pods},
    )


def ready_pod(block: KubernetesCluster, name: str) -> str:
    """The name of the service's one ready pod (reached through the API server's pod proxy)."""
    (pod,) = ready_pods(block, name)
    return pod["metadata"]["name"]


def test_retrain_serves_on_kubernetes_and_a_bad_release_rolls_back(
    k8s: dict[str, str],
    k8s_namespace: str,
    workload_builder: DockerImageBuilder,
    s3_store: S3CheckpointStore,
    s3_for_pods: dict[str, str],
    slurm_in_images: SlurmCluster,
) -> None:
    block = serving_block(k8s, k8s_namespace, env={"WARMUP_ITERATIONS": "1"})
    with_store_secret(block, k8s_namespace, s3_for_pods)
    tracking = mlflow_server()
    tag = uuid.uuid4().hex[:8]
    model, experiment = f"digits-k8s-{tag}", f"gpuferry-k8s-{tag}"
    training = TrainingSpec(
        model_name=model, experiment=experiment, hyperparameters={"epochs": 15, "lr": 0.05}, resources=RESOURCES
    )
    serving = ServingSpec(service_name="digits", replicas=1, ready_timeout_seconds=300)

    # ---- a first version: built, trained, stored, registered, served --------------------------------
    stack = save_stack(block, workload_builder, slurm_in_images, s3_store, tracking)
    first = retrain(workload=str(DIGITS), training=training, serving=serving, stack=stack)

    assert first.deployed and first.model_version.version == "1"
    image = first.image.reference
    assert image and image.startswith(f"{stack_env('registry')['REGISTRY_URL']}/gpuferry-test/workload@sha256:")
    dep = block._api().get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == image  # by digest, from the build step
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    assert dep["spec"]["template"]["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    assert dep["status"]["availableReplicas"] == 1
    # env_from_secret names the user's Secret: the pods read it, and the deploy makes none of its own.
    assert dep["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": SECRET}}]
    secrets = f"/api/v1/namespaces/{k8s_namespace}/secrets"
    assert block._api().get_or_none(f"{secrets}/{m.store_secret_name(serving)}") is None

    # The pod's server loaded the checkpoint from S3 by its MODEL_URI, and classifies held-out digits.
    pod = ready_pod(block, "digits")
    status, ready = block.pod_request(pod, "/readyz")
    assert status == 200 and ready["model"]["checkpoint_sha256"] == first.checkpoint.sha256
    assert first.checkpoint.uri.startswith("s3://")
    x_test, y_test = example_module(DIGITS, "data").load_digits_split()["test"]
    status, answer = block.pod_request(pod, "/invocations", {"inputs": x_test.tolist()})
    assert status == 200
    accuracy = float((np.asarray(answer["predictions"]).argmax(axis=1) == y_test).mean())  # class probabilities
    assert accuracy >= 0.9  # 0.95-0.97 with these settings (tests/test_pipeline_embedded.py)

    client = tracking.client
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["backend.compute"] == "gpuferry-slurm-cluster" and run.data.metrics["gpu_hours"] > 0
    for tags in (run.data.tags, client.get_model_version(model, "1").tags):
        assert tags["deploy.status"] == "deployed" and tags["deploy.version"] == "1"
        assert tags["deploy.endpoint"] == first.endpoint.url == f"http://digits.{k8s_namespace}.svc.cluster.local:80"
        assert tags["deploy.backend"] == "gpuferry-kubernetes-cluster"
        assert "deploy.previous_version" not in tags and "deploy.reason" not in tags

    # ---- a bad release: v2's server exits at start (a setting it rejects) ---------------------------
    crashing = serving_block(k8s, k8s_namespace, env={"WARMUP_ITERATIONS": "1", "MAX_QUEUE": "0"})
    bad_stack = save_stack(crashing, workload_builder, slurm_in_images, s3_store, tracking)
    with pytest.raises(RolledBack, match="CrashLoopBackOff") as failed:
        retrain(
            workload=str(DIGITS),
            training=training.model_copy(update={"hyperparameters": {"epochs": 1}}),
            serving=serving,
            stack=bad_stack,
            force_deploy=True,
        )
    assert failed.value.failed_version == "2" and failed.value.rolled_back_to == "1"

    run = client.get_run(client.get_model_version(model, "2").run_id)
    assert run.info.status == "FAILED"  # the flow failed, and said why
    for tags in (run.data.tags, client.get_model_version(model, "2").tags):
        assert tags["deploy.status"] == "rolled_back"
        assert tags["deploy.failed_version"] == "2" and tags["deploy.rolled_back_to"] == "1"
        assert tags["deploy.reason"] == "CrashLoopBackOff"
        assert "exit code 2" in tags["deploy.message"] and "v1 is available again" in tags["deploy.message"]
        assert "deploy.endpoint" not in tags
    assert client.get_model_version(model, "1").tags["deploy.status"] == "deployed"  # v1's record is its own
    artifact = Artifact.get("deploy-digits")  # the newest of that key
    assert artifact and "rolled back** (CrashLoopBackOff): v1 serves again" in str(artifact.data)

    # v1 serves again, from the same image and checkpoint.
    dep = block._api().get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits")
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == image
    pod = ready_pod(block, "digits")
    assert block.pod_request(pod, "/readyz")[1]["model"]["checkpoint_sha256"] == first.checkpoint.sha256
    assert block.pod_request(pod, "/invocations", {"inputs": [[0.0] * 64]})[0] == 200

    # ---- `gpuferry rollback`: v2 made champion and served (as the alias's trigger would), then back to v1 -------
    client.set_registered_model_alias(model, "champion", "2")
    served = deploy_model(model_name=model, alias="champion", stack=stack)
    assert served is not None and served.model_version == "2"
    assert client.get_model_version(model, "2").tags["deploy.previous_version"] == "1"
    done = subprocess.run(
        [sys.executable, "-c", "from deployments.cli import main; main()", "rollback", "digits", "--stack", stack],
        cwd=REPO,
        env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},  # the test's Prefect server
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "alias 'champion' points at v1" in done.stdout
    dep = block._api().get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/digits")
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "1"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["template"]["spec"]["containers"][0]["image"] == image
    assert ready_pod(block, "digits") and block.current("digits")["version"] == "1"
    assert client.get_model_version_by_alias(model, "champion").version == "1"
    assert client.get_model_version(model, "2").tags["rollback.to"] == "1"
    block.undeploy("digits")


def test_the_regressor_trains_on_slurm_and_serves_on_kubernetes(
    k8s: dict[str, str],
    k8s_namespace: str,
    workload_builder: DockerImageBuilder,
    s3_store: S3CheckpointStore,
    s3_for_pods: dict[str, str],
    slurm_in_images: SlurmCluster,
) -> None:
    # No env_from_secret: the deploy puts the store's credentials into a Secret of the service's own.
    block = serving_block(
        k8s, k8s_namespace, env_from_secret=None, env={"AWS_ENDPOINT_URL": s3_for_pods["AWS_ENDPOINT_URL"]}
    )
    tracking = mlflow_server()
    tag = uuid.uuid4().hex[:8]
    model = f"diabetes-k8s-{tag}"
    stack = save_stack(block, workload_builder, slurm_in_images, s3_store, tracking)
    outcome = retrain(
        workload=str(DIABETES),
        stack=stack,
        training=TrainingSpec(
            model_name=model, experiment=f"gpuferry-k8s-{tag}", hyperparameters={"alpha": 0.05}, resources=RESOURCES
        ),
        serving=ServingSpec(replicas=1, ready_timeout_seconds=300),
    )

    assert outcome.deployed and outcome.model_version.version == "1"
    assert outcome.endpoint.url == f"http://diabetes.{k8s_namespace}.svc.cluster.local:80"  # the workload's service
    assert outcome.image.reference and "@sha256:" in outcome.image.reference  # its own, from its requirements
    run = tracking.client.get_run(outcome.run_id)
    assert run.data.tags["backend.compute"] == "gpuferry-slurm-cluster"
    assert (
        run.data.metrics["val_rmse"] == pytest.approx(outcome.model_version.value)
        and 0 < outcome.model_version.value < 80
    )
    assert run.data.params["alpha"] == "0.05"

    # The Secret holds the store's keys; the Deployment and the pod name it and hold none of them.
    key = s3_store.bucket.credentials.aws_secret_access_key.get_secret_value()
    secret_path = f"/api/v1/namespaces/{k8s_namespace}/secrets/diabetes{m.STORE_SECRET_SUFFIX}"
    secret = block._api().get(secret_path)
    assert m.is_ours(secret) and base64.b64decode(secret["data"]["AWS_SECRET_ACCESS_KEY"]).decode() == key
    assert base64.b64decode(secret["data"]["AWS_ACCESS_KEY_ID"]).decode() == s3_for_pods["AWS_ACCESS_KEY_ID"]
    assert "AWS_ENDPOINT_URL" not in secret["data"]  # the block's env gives the pods' address instead
    dep = block._api().get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/diabetes")
    (pod_obj,) = ready_pods(block, "diabetes")
    for obj in (dep["spec"]["template"]["spec"], pod_obj["spec"]):
        assert obj["containers"][0]["envFrom"] == [{"secretRef": {"name": f"diabetes{m.STORE_SECRET_SUFFIX}"}}]
    assert key not in json.dumps(dep) and key not in json.dumps(pod_obj)

    pod = ready_pod(block, "diabetes")
    status, ready = block.pod_request(pod, "/readyz")
    assert status == 200 and ready["model"]["checkpoint_sha256"] == outcome.checkpoint.sha256
    rows = example_module(DIABETES, "train").load_diabetes(as_frame=True).data.head(3)
    split = {"columns": list(rows.columns), "data": rows.to_numpy().tolist()}
    status, answer = block.pod_request(pod, "/invocations", {"dataframe_split": split})
    assert status == 200 and len(answer["predictions"]) == 3
    assert all(0 < p < 400 for p in answer["predictions"])  # disease progression: 25-346 in the data set
    status, _ = block.pod_request(pod, "/invocations", {"dataframe_split": {**split, "columns": split["columns"][:-1]}})
    assert status == 422  # a column short of the model's signature
    block.undeploy("diabetes")
    assert block._api().get_or_none(secret_path) is None  # the Secret goes with the service


def test_no_gpu_node_stops_the_retrain_before_it_trains(
    k8s: dict[str, str], k8s_namespace: str, workload_builder: DockerImageBuilder
) -> None:
    stack = Stack.embedded()
    stack.images = (
        workload_builder  # a stack serving on Kubernetes builds an image (not reached: the check comes first)
    )
    stack.serving = serving_block(k8s, k8s_namespace)
    name = f"k8s-preflight-{uuid.uuid4().hex[:8]}"
    stack.save(name)
    experiment = f"gpuferry-k8s-preflight-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=r"no schedulable node offers 1 × nvidia.com/mig-2g.20gb"):
        retrain(
            workload=str(DIGITS),
            training=TrainingSpec(model_name="digits-k8s-preflight", experiment=experiment),
            serving=ServingSpec(mig_profile="2g.20gb"),
            stack=name,
        )
    assert stack.tracking.client.get_experiment_by_name(experiment) is None
    assert stack.serving.current("digits") is None  # nothing was applied either
