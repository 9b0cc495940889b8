"""`retrain` with a Stack of Docker backends (`make registry-up s3-up mlflow-up`): the provider's nvidia-smi
inventory (LocalMachine, stand-in GPUs) feeds the GPU choice of both the training job and the inference server.

The checkpoint goes to the s3 stack; the server container loads it from there through the relay the Kubernetes
pipeline test uses (moto listens on loopback, which a container on the bridge does not share), its credentials
passed by name (DockerServing.pass_env) in a 0600 file."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.docker_compute import DockerCompute
from blocks.docker_image import DockerImageBuilder
from blocks.docker_serving import DockerServing
from blocks.provision import LocalMachine
from blocks.specs import Resources, ServingSpec, TrainingSpec
from blocks.stack import Stack
from blocks.s3 import S3CheckpointStore
from blocks.tracking import MlflowTracking
from tests.fake_gpus import FakeGpus, fake_gpus
from tests.stacks import stack_env
from tests.test_docker_compute import credentials


pytestmark = pytest.mark.integration


@pytest.fixture
def gpus(tmp_path: Path) -> Iterator[FakeGpus]:
    with fake_gpus(tmp_path / "gpus", count=2) as fake:
        yield fake


@pytest.mark.usefixtures("prefect_server")
def test_retrain_on_a_docker_host_trains_and_serves_on_the_providers_gpus(
    gpus: FakeGpus, tmp_path: Path, s3_store: S3CheckpointStore, s3_for_containers: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from mlflow import MlflowClient

    from flows.retrain import retrain
    from tests.examples import DIGITS

    for key, value in s3_for_containers.items():  # what the server container gets by name (pass_env)
        monkeypatch.setenv(key, value)
    registry, mlflow_env = stack_env("registry"), stack_env("mlflow")
    registry["REGISTRY_PASSWORD"] = Path(registry["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    host = DockerHost(base_url=registry["DOCKER_HOST"])
    context = tmp_path / "digits"
    shutil.copytree(DIGITS, context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    builder = DockerImageBuilder(docker_host=host, credentials=credentials(registry), repository="gpuferry-test/docker-pipeline",
                                 build_args={"BASE_IMAGE": registry["BASE_IMAGE"]})  # fmt: skip
    service = f"digits-{uuid.uuid4().hex[:6]}"
    serving = DockerServing(docker_host=host, registry_credentials=credentials(registry), cdi_kind=gpus.kind,
                            env={"WARMUP_ITERATIONS": "1"}, drain_seconds=5)  # fmt: skip
    stack = Stack(
        provider=LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent"), images=builder,
        compute=DockerCompute(docker_host=host, registry_credentials=credentials(registry), cdi_kind=gpus.kind,
                              workdir_root=str(tmp_path / "jobs")),
        storage=s3_store,
        tracking=MlflowTracking(tracking_uri=mlflow_env["MLFLOW_TRACKING_URI"], artifact_location=None),
        serving=serving,
    )  # fmt: skip
    name = f"docker-{uuid.uuid4().hex[:8]}"
    stack.save(name, overwrite=True)
    tag = uuid.uuid4().hex[:8]
    engine = docker.DockerClient(base_url=registry["DOCKER_HOST"], timeout=300)
    try:
        outcome = retrain(
            workload=str(context),
            training=TrainingSpec(experiment=f"gpuferry-docker-{tag}", model_name=f"digits-docker-{tag}",
                                  hyperparameters={"epochs": 3, "hidden": 16},
                                  resources=Resources(gpu_devices=[gpus.uuids[1]], mem_gb=2)),
            serving=ServingSpec(service_name=service, gpus=1, ready_timeout_seconds=240),
            stack=name, force_deploy=True,
        )  # fmt: skip
        assert outcome.deployed and outcome.endpoint is not None
        version = MlflowClient(tracking_uri=mlflow_env["MLFLOW_TRACKING_URI"]).get_model_version(
            f"digits-docker-{tag}", outcome.model_version.version)
        assert version.tags["deploy.status"] == "deployed" and version.tags["deploy.backend"] == "gpuferry-docker-serving"
        assert version.tags["deploy.endpoint"] == outcome.endpoint.url
        run = MlflowClient(tracking_uri=mlflow_env["MLFLOW_TRACKING_URI"]).get_run(outcome.run_id)
        assert run.data.tags["backend.compute"] == "gpuferry-docker-compute"
        assert run.data.metrics["val_accuracy"] == pytest.approx(outcome.model_version.value)  # logged from inside
        assert run.data.metrics["gpu_hours"] > 0
        # The server got a GPU of the provider's inventory; the request the deploy gate sent works from here too.
        server = engine.containers.get(serving.active_name(service))
        assert server.labels["io.gpuferry.gpus"] in gpus.uuids
        final = Path(tmp_path / "jobs" / f"{run.data.tags['prefect.flow_run_id']}-train" / "checkpoints" / "final")
        example = (final / "serving_input_example.json").read_text()
        answer = httpx.post(f"{outcome.endpoint.url}/invocations", content=example,
                            headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
        assert outcome.checkpoint.uri.startswith("s3://")
        assert answer.status_code == 200, answer.text
    finally:
        serving.undeploy(service)
        for local in engine.images.list(name=builder.image_name()):
            try:
                engine.images.remove(local.id, force=True)
            except docker.errors.APIError:
                pass
        engine.close()
