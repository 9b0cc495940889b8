"""`retrain` with a Stack of Docker backends (`make registry-up s3-up mlflow-up`): the provider's nvidia-smi
inventory (LocalMachine, stand-in GPUs) feeds the GPU choice of both the training job and the inference server.

The checkpoint goes to the s3 stack; the server container loads it from there through the relay the Kubernetes
pipeline test uses (moto listens on loopback, which a container on the bridge does not share), its credentials
passed by name (DockerServing.pass_env) in a 0600 file."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.docker.compute import DockerCompute
from blocks.docker.image import DockerImageBuilder
from blocks.docker.serving import DockerServing
from blocks.errors import ConfigurationError
from blocks.local.provider import LocalMachine
from blocks.specs import Resources, ServingSpec, TrainingSpec
from blocks.stack import Stack
from blocks.storage.s3 import S3CheckpointStore
from tests.fake_gpus import FakeGpus, fake_gpus
from tests.stacks import mlflow_server, stack_env
from tests.test_docker_compute import credentials

pytestmark = pytest.mark.integration


@pytest.fixture
def gpus(tmp_path: Path) -> Iterator[FakeGpus]:
    with fake_gpus(tmp_path / "gpus", count=2) as fake:
        yield fake


def _registry() -> dict[str, str]:
    registry = stack_env("registry")
    registry["REGISTRY_PASSWORD"] = Path(registry["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    return registry


def docker_stack(gpus: FakeGpus, root: Path, storage: S3CheckpointStore, repository: str) -> Stack:
    """LocalMachine (its nvidia-smi reports the stand-in GPUs) + DockerImageBuilder + DockerCompute + ``storage`` +
    the mlflow stack's server + DockerServing, all on the registry stack's podman."""
    registry = _registry()
    host = DockerHost(base_url=registry["DOCKER_HOST"])
    return Stack(
        provider=LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent"),
        images=DockerImageBuilder(
            docker_host=host,
            credentials=credentials(registry),
            repository=repository,
            build_args={"BASE_IMAGE": registry["BASE_IMAGE"]},
        ),
        compute=DockerCompute(
            docker_host=host,
            registry_credentials=credentials(registry),
            cdi_kind=gpus.kind,
            workdir_root=str(root / "jobs"),
        ),
        storage=storage,
        tracking=mlflow_server(),
        serving=DockerServing(
            docker_host=host,
            registry_credentials=credentials(registry),
            cdi_kind=gpus.kind,
            env={
                "WARMUP_ITERATIONS": "1",
                "MODEL_DEVICE": "cpu",
            },  # the stand-in GPUs have no CUDA: the server runs the model on the CPU
            drain_seconds=5,
        ),
    )


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize(
    ("case", "resources", "serving_gpus", "error"),
    [
        ("serving count", {}, 3, r"asks for 3 GPU\(s\) but Docker host .* has 2: 0 \(GPU-"),
        (
            "training index",
            {"gpu_devices": ["1", "7"]},
            1,
            r"names '7', which Docker host .* does not have; it has 2 GPU\(s\): 0 \(GPU-",
        ),
        (
            "training UUID",
            {"gpu_devices": ["GPU-00000000-nope"]},
            1,
            r"names 'GPU-00000000-nope', which Docker host .* does not have; it has 2 GPU\(s\): 0 \(GPU-",
        ),
    ],
)
def test_gpus_the_host_lacks_fail_the_retrain_before_anything_is_built_or_run(
    case: str,
    resources: dict,
    serving_gpus: int,
    error: str,
    gpus: FakeGpus,
    tmp_path: Path,
    s3_store: S3CheckpointStore,
) -> None:
    """Training's and serving's GPU requests are checked against the provider's inventory first: no node
    provisioned, no image built, no MLflow run, no job, no server, no front."""
    from flows.retrain import retrain
    from tests.examples import DIGITS

    tag = uuid.uuid4().hex[:8]
    stack = docker_stack(gpus, tmp_path, s3_store, f"gpuferry-test/preflight-{tag}")
    name = f"docker-preflight-{tag}"
    stack.save(name, overwrite=True)
    service = f"digits-{tag}"
    state = retrain(
        workload=str(DIGITS),
        training=TrainingSpec(
            experiment=f"gpuferry-preflight-{tag}",
            model_name=f"digits-preflight-{tag}",
            hyperparameters={"epochs": 1},
            resources=Resources(**resources),
        ),
        serving=ServingSpec(service_name=service, gpus=serving_gpus),
        stack=name,
        force_deploy=True,
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(ConfigurationError, match=error):
        state.result()
    assert tasks_of(state.state_details.flow_run_id) <= {"load-workload", "host-inventory", "serving-preflight"}
    mlflow = mlflow_server().client
    assert mlflow.get_experiment_by_name(f"gpuferry-preflight-{tag}") is None  # no run was started
    engine = docker.DockerClient(base_url=_registry()["DOCKER_HOST"], timeout=300)
    try:
        assert isinstance(stack.images, DockerImageBuilder)
        assert engine.images.list(name=stack.images.image_name()) == []  # nothing was built
        assert engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service}"}) == []
    finally:
        engine.close()
    assert not (tmp_path / "jobs").exists()  # no job was submitted


def tasks_of(flow_run_id: object) -> set[str]:
    """The tasks the flow run ran (nodes provisioned, an image built, a run started would show here)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0] for run in runs}


@pytest.mark.usefixtures("prefect_server")
def test_retrain_on_a_docker_host_trains_and_serves_on_the_providers_gpus(
    gpus: FakeGpus,
    tmp_path: Path,
    s3_store: S3CheckpointStore,
    s3_for_containers: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.retrain import retrain
    from tests.examples import DIGITS

    for key, value in s3_for_containers.items():  # what the server container gets by name (pass_env)
        monkeypatch.setenv(key, value)
    registry = _registry()
    context = tmp_path / "digits"
    shutil.copytree(DIGITS, context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    stack = docker_stack(gpus, tmp_path, s3_store, "gpuferry-test/docker-pipeline")
    builder, serving = stack.images, stack.serving
    assert isinstance(builder, DockerImageBuilder) and isinstance(serving, DockerServing)
    service = f"digits-{uuid.uuid4().hex[:6]}"
    name = f"docker-{uuid.uuid4().hex[:8]}"
    stack.save(name, overwrite=True)
    tag = uuid.uuid4().hex[:8]
    engine = docker.DockerClient(base_url=registry["DOCKER_HOST"], timeout=300)
    try:
        outcome = retrain(
            workload=str(context),
            training=TrainingSpec(
                experiment=f"gpuferry-docker-{tag}",
                model_name=f"digits-docker-{tag}",
                hyperparameters={"epochs": 3, "hidden": 16},
                resources=Resources(gpu_devices=[gpus.uuids[1]], mem_gb=2),
            ),
            serving=ServingSpec(service_name=service, gpus=1, ready_timeout_seconds=240),
            stack=name,
            force_deploy=True,
        )
        assert outcome.deployed and outcome.endpoint is not None
        version = mlflow_server().client.get_model_version(f"digits-docker-{tag}", outcome.model_version.version)
        assert (
            version.tags["deploy.status"] == "deployed" and version.tags["deploy.backend"] == "gpuferry-docker-serving"
        )
        assert version.tags["deploy.endpoint"] == outcome.endpoint.url
        run = mlflow_server().client.get_run(outcome.run_id)
        assert run.data.tags["backend.compute"] == "gpuferry-docker-compute"
        assert run.data.metrics["val_accuracy"] == pytest.approx(outcome.model_version.value)  # logged from inside
        assert run.data.metrics["gpu_hours"] > 0
        # The server got a GPU of the provider's inventory; the request the deploy gate sent works from here too.
        server = engine.containers.get(serving.active_name(service))
        assert server.labels["io.gpuferry.gpus"] in gpus.uuids
        final = Path(tmp_path / "jobs" / f"{run.data.tags['prefect.flow_run_id']}-train" / "checkpoints" / "final")
        example = (final / "serving_input_example.json").read_text()
        answer = httpx.post(
            f"{outcome.endpoint.url}/invocations",
            content=example,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert outcome.checkpoint.uri.startswith("s3://")
        assert answer.status_code == 200, answer.text
    finally:
        serving.undeploy(service)
        for local in engine.images.list(name=builder.image_name()):
            with contextlib.suppress(docker.errors.APIError):
                engine.images.remove(local.id, force=True)
        engine.close()
