"""The serving shape a workload declares, recorded on the model version, served by deploy-model on the real node.

A workload's ``gpuferry.yaml`` declares two replicas of one whole GPU each, and their CPU and memory; a version is
registered as a run registers it (``RunPlan.version_tags``); ``deploy-model`` of that version, given no ``serving``
(as the ``on-champion`` trigger runs it, or a rollback by hand), serves it on the local Kubernetes node with the
declared replicas and the stand-in GPU resource; a deploy that sets ``replicas`` changes only that. The node's
GPUs are the fake device plugin's (no CUDA): the stack's ``env`` tells the servers to run the model on the CPU.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect.filesystems import LocalFileSystem
from pydantic import SecretStr

from blocks.base.provider import ClusterManaged
from blocks.docker.image import DockerImageBuilder
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.local.compute import LocalProcesses
from blocks.local.storage import LocalCheckpointStore
from blocks.plan import SERVING_TAG, plan_run
from blocks.records import CheckpointRef, ImageRef
from blocks.specs import PromotionPolicy, ServingShape, ServingSpec, TrainingSpec
from blocks.stack import Stack
from blocks.tracking.mlflow import MlflowTracking
from blocks.workload.source import load_workload
from flows.deploy_model import deploy_model
from tests.k8s_node import PULL_SECRET, ready_pods, write_test_models

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

WORKLOAD = """\
name: {name}
train:
  command: [python, train.py]
promotion: {{metric: val_accuracy, direction: maximize}}
serve:
  service_name: shaped
  replicas: 2
  gpus: 1
  cpu_request: 20m
  memory_request: 96Mi
  memory_limit: 768Mi
  input_example: {{inputs: [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    0.0, 0.0]]}}
"""


def test_a_version_serves_with_the_shape_its_workload_declared(
    k8s: dict[str, str],
    k8s_namespace: str,
    workload_builder: DockerImageBuilder,
    workload_image: str,
    tmp_path: Path,
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    sha256 = {width: sha for sha, width in write_test_models(models, (16,)).items()}[16]
    model_dir = models / "model-16"
    name = f"shaped-{uuid.uuid4().hex[:6]}"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "gpuferry.yaml").write_text(WORKLOAD.format(name=name))
    (tmp_path / "w" / "train.py").write_text("print('trained')\n")
    work = load_workload(str(tmp_path / "w"))

    # Registered as a run registers it: its tags record the shape it served with.
    tracking = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = plan_run(work, TrainingSpec(), ServingSpec(), PromotionPolicy())
    image = ImageRef(builder="docker", content_tag="t", reference=workload_image, built=False)
    experiment = tracking.client.create_experiment(name)
    run_id = tracking.client.create_run(experiment).info.run_id
    checkpoint = CheckpointRef(uri=model_dir.as_uri(), sha256=sha256, size_bytes=1, files=1)
    version = tracking.register(name, run_id, checkpoint, "val_accuracy", 0.9, run.version_tags(image))
    recorded = ServingShape.model_validate_json(tracking.version_tags(name, version)[SERVING_TAG])
    assert (recorded.replicas, recorded.gpus, recorded.memory_limit) == (2, 1, "768Mi")

    serving = KubernetesCluster(
        kubeconfig=SecretStr(Path(k8s["KUBECONFIG"]).read_text()),
        namespace=k8s_namespace,
        image_pull_secret=PULL_SECRET,
        rollout_timeout_seconds=300,
        host_path_mounts={str(models): str(models)},  # the checkpoint at the same path for the flow and the pods
        # The node's GPUs are stand-ins without CUDA: the servers run the model on the CPU.
        env={"WARMUP_ITERATIONS": "1", "MODEL_DEVICE": "cpu"},
    )
    stack = Stack(
        provider=ClusterManaged(cluster_name="gpuferry-test"),
        images=workload_builder,  # not called: the version records its image
        compute=LocalProcesses(),
        storage=LocalCheckpointStore(filesystem=LocalFileSystem(basepath=str(tmp_path / "store"))),
        tracking=tracking,
        serving=serving,
    )

    def deployment() -> dict[str, Any]:
        return serving._api().get(f"/apis/apps/v1/namespaces/{k8s_namespace}/deployments/shaped")

    try:
        # As the on-champion trigger runs it: no serving, the version's own shape.
        endpoint = deploy_model(model_name=name, version=version, alias=None, stack=stack)
        assert endpoint is not None and endpoint.model_version == version
        dep = deployment()
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert dep["spec"]["replicas"] == 2 and dep["status"]["availableReplicas"] == 2
        assert container["resources"]["limits"] == {"memory": "768Mi", "nvidia.com/gpu": "1"}
        assert container["resources"]["requests"] == {"cpu": "20m", "memory": "96Mi"}
        assert len(ready_pods(serving, "shaped")) == 2

        # A deploy that sets replicas changes only that: the GPU and the memory stay as declared.
        deploy_model(model_name=name, version=version, alias=None, stack=stack, serving=ServingSpec(replicas=1))
        dep = deployment()
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert dep["spec"]["replicas"] == 1
        assert container["resources"]["limits"] == {"memory": "768Mi", "nvidia.com/gpu": "1"}
    finally:
        serving.undeploy("shaped")
