"""DockerServing against the registry stack's podman (`make registry-up`), with stand-in GPUs.

The regressor example trains in its image with DockerCompute; its MLflow model is then served by gpuferry's
model server from the same image, on GPUs chosen as for training jobs. A second version replaces the first
only once it is ready and answered the smoke request; a version whose image cannot serve is removed while the
first keeps answering.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.docker_compute import DockerCompute
from blocks.docker_serving import DockerServing
from blocks.errors import ConfigurationError, DeployFailed
from blocks.gpu_alloc import GpusBusy
from blocks.provision import LocalMachine
from blocks.serving import DeployOutcome, Release
from blocks.specs import ImageRef, Resources, ServerSpec, ServingSpec, TrainingJob
from blocks.storage import write_manifest
from tests.fake_gpus import FakeGpus, fake_gpus
from tests.test_docker_compute import credentials, engine, stack  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TINY_WORKLOAD = "name: tiny\nimage: {dockerfile: Dockerfile}\ntrain: {command: [sh, -c, 'true']}\n" \
    "promotion: {metric: m}\nserve: {command: [sh, -c, 'true'], port: 8080}\n"  # fmt: skip


@pytest.fixture(scope="module")
def gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGpus]:
    with fake_gpus(tmp_path_factory.mktemp("gpus"), count=2) as fake:
        yield fake


def _builder(stack: dict[str, str], repository: str, base: str):  # noqa: ANN202 - a DockerImageBuilder
    from blocks.docker_image import DockerImageBuilder

    return DockerImageBuilder(docker_host=DockerHost(base_url=stack["DOCKER_HOST"]), credentials=credentials(stack),
                              repository=repository, build_args={"BASE_IMAGE": base, "BASE": base})  # fmt: skip


@pytest.fixture(scope="module")
def images(stack: dict[str, str], engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ImageRef, ImageRef]]:  # fmt: skip
    """(the regressor's image, an image without Python: gpuferry's server cannot start in it)."""
    from blocks.workload import load_workload
    from tests.examples import DIABETES

    good_builder = _builder(stack, "gpuferry-test/docker-serving", stack["BASE_IMAGE"])
    good = good_builder.build(load_workload(str(DIABETES)))
    context = tmp_path_factory.mktemp("bad")
    (context / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nCOPY gpuferry.yaml /app/gpuferry.yaml\n")
    (context / "gpuferry.yaml").write_text(TINY_WORKLOAD)
    bad_builder = _builder(stack, "gpuferry-test/docker-serving-bad", stack["TINY_BASE_IMAGE"])
    bad = bad_builder.build(load_workload(str(context)))
    assert good.reference and bad.reference
    yield good, bad
    for builder in (good_builder, bad_builder):
        for local in engine.images.list(name=builder.image_name()):
            try:
                engine.images.remove(local.id, force=True)
            except docker.errors.APIError:
                pass


def _inventory(gpus: FakeGpus) -> list:
    return LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent").host_inventory()


@pytest.fixture(scope="module")
def model(stack: dict[str, str], gpus: FakeGpus, images: tuple[ImageRef, ImageRef],
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:  # fmt: skip
    """The regressor trained in its image (DockerCompute), stored as a checkpoint with its manifest."""
    root = tmp_path_factory.mktemp("train")
    c = DockerCompute(docker_host=DockerHost(base_url=stack["DOCKER_HOST"]), registry_credentials=credentials(stack),
                      cdi_kind=gpus.kind, workdir_root=str(root)).with_inventory(_inventory(gpus))  # fmt: skip
    key = f"t{uuid.uuid4().hex[:8]}-regressor"
    job = TrainingJob(key=key, workdir=c.job_workdir(key), image=images[0], command=["python", "train.py"],
                      env={"HPARAMS": json.dumps({"alpha": 0.05})}, resources=Resources(time_limit_minutes=10))  # fmt: skip
    handle = c.submit(job)
    status = c.watch(handle, timeout_seconds=600)
    final = Path(c.result(handle, status).checkpoint_dir) / "final"
    write_manifest(final)
    return final.as_uri(), json.loads((final / "serving_input_example.json").read_text())


@pytest.fixture
def serving(stack: dict[str, str], gpus: FakeGpus) -> Iterator[DockerServing]:
    block = DockerServing(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]), registry_credentials=credentials(stack),
        cdi_kind=gpus.kind, health_interval_seconds=2, drain_seconds=10, env={"WARMUP_ITERATIONS": "1"},
    ).with_inventory(_inventory(gpus))  # fmt: skip
    assert isinstance(block, DockerServing)
    yield block
    block.undeploy(service_name)


service_name = f"regressor-{uuid.uuid4().hex[:6]}"


def release(version: str, image: ImageRef, model: tuple[str, dict]) -> Release:
    return Release(model_name="diabetes", version=version, model_uri=model[0], image=image, server=ServerSpec())


def spec(model: tuple[str, dict], **fields: object) -> ServingSpec:
    return ServingSpec(service_name=service_name, smoke_request=model[1], ready_timeout_seconds=240, **fields)


def devices(engine: docker.DockerClient, container: str) -> list[str]:
    out = engine.containers.get(container).exec_run(["sh", "-c", "ls /dev | grep '^nvidia' || true"])
    return sorted(out.output.decode().split())


def predict(url: str, request: dict) -> int:
    try:
        return httpx.post(f"{url}/invocations", json=request, timeout=30).status_code
    except httpx.HTTPError:
        return 0


def test_deploy_switch_and_a_bad_image_leaves_the_old_one_serving(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], model: tuple[str, dict], engine: docker.DockerClient,
) -> None:  # fmt: skip
    good, bad = images
    first = serving.deploy(spec(model, gpu_devices=["1"]), release("1", good, model))
    assert first.model_version == "1" and first.previous_version is None
    assert predict(first.url, model[1]) == 200
    active = serving.active_name(service_name)
    assert devices(engine, active) == ["nvidia1"]  # the GPU asked for by index, nothing else
    info = engine.api.inspect_container(active)
    assert info["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert info["Config"]["Healthcheck"]["Test"][:2] == ["CMD", "python"]  # the engine's own check of /healthz
    now = serving.current(service_name)
    assert now is not None and now["version"] == "1" and now["url"] == first.url
    # The same version again changes nothing.
    again = serving.deploy(spec(model, gpu_devices=["1"]), release("1", good, model))
    assert again.detail["changed"] is False and again.url == first.url

    # A version whose image cannot serve: removed; v1 answers all along and still serves.
    answers: list[int] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            answers.append(predict(first.url, model[1]))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        with pytest.raises(DeployFailed, match=r"v2 of .* was removed, v1 keeps serving: ") as caught:
            serving.deploy(spec(model, gpus=1), release("2", bad, model))
    finally:
        stop.set()
        asker.join(60)
    assert "exited (exit code 127) before it was ready" in str(caught.value)
    assert "python: not found" in str(caught.value)  # the tail of its log comes with the error
    assert answers and set(answers) == {200}, answers
    assert serving.current(service_name)["version"] == "1"
    assert [c.name for c in engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service_name}"})] == [active]
    tags = DeployOutcome.from_error(release("2", bad, model), caught.value).tags()
    assert tags["deploy.status"] == "failed" and tags["deploy.failed_version"] == "2"
    assert tags["deploy.reason"].startswith("DeployFailed: v2 of")

    # A good v2 by count: a free GPU (not v1's), ready and answering before it takes the service's name.
    second = serving.deploy(spec(model, gpus=1), release("2", good, model))
    assert second.previous_version == "1" and second.url != first.url
    assert predict(second.url, model[1]) == 200 and predict(first.url, model[1]) == 0  # v1 drained and gone
    assert devices(engine, active) == ["nvidia0"]
    assert serving.current(service_name)["version"] == "2"
    tags = DeployOutcome.deployed(release("2", good, model), second).tags()
    assert tags["deploy.status"] == "deployed" and tags["deploy.backend"] == "gpuferry-docker-serving"
    assert tags["deploy.endpoint"] == second.url and tags["deploy.previous_version"] == "1"


def test_gpus_the_host_lacks_or_that_others_hold_fail_before_a_container_starts(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], model: tuple[str, dict], engine: docker.DockerClient,
) -> None:  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"names '5', which Docker host .* does not have; it has 2 GPU\(s\)"):
        serving.deploy(spec(model, gpu_devices=["5"]), release("1", images[0], model))
    with pytest.raises(ConfigurationError, match=r"asks for 3 GPU\(s\) but Docker host .* has 2"):
        serving.preflight(spec(model, gpus=3))
    first = serving.deploy(spec(model, gpu_devices=[serving.gpu_inventory[0].uuid]), release("1", images[0], model))
    other = serving.model_copy()
    other_spec = spec(model, gpu_devices=["0"]).model_copy(update={"service_name": f"{service_name}-other"})
    with pytest.raises(GpusBusy, match=r"GPU 0 .* by container gpuferry-serve-"):
        other.deploy(other_spec, release("1", images[0], model))
    assert engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service_name}-other"}) == []
    assert predict(first.url, model[1]) == 200


def test_a_training_job_and_a_server_on_the_same_host_get_disjoint_gpus(
    serving: DockerServing, stack: dict[str, str], gpus: FakeGpus, images: tuple[ImageRef, ImageRef],
    model: tuple[str, dict], engine: docker.DockerClient, tmp_path: Path,
) -> None:  # fmt: skip
    """Training and serving choose from one record, the engine's labels: neither takes the other's GPU."""
    compute = DockerCompute(docker_host=DockerHost(base_url=stack["DOCKER_HOST"]), cdi_kind=gpus.kind,
                            registry_credentials=credentials(stack), workdir_root=str(tmp_path / "jobs"),
                            stop_timeout_seconds=5).with_inventory(_inventory(gpus))  # fmt: skip
    assert isinstance(compute, DockerCompute)

    def job(name: str) -> TrainingJob:
        key = f"t{uuid.uuid4().hex[:8]}-{name}"
        return TrainingJob(key=key, workdir=compute.job_workdir(key), image=images[0],
                           command=["python", "-c", "import time; time.sleep(900)"],
                           resources=Resources(time_limit_minutes=20, gpus_per_node=1))  # fmt: skip

    trainer = job("holds")
    handle = compute.submit(trainer)
    try:
        held = devices(engine, compute.container_of(trainer.key))
        assert len(held) == 1
        served = serving.deploy(spec(model, gpus=1), release("1", images[0], model))
        assert predict(served.url, model[1]) == 200
        assert len(devices(engine, serving.active_name(service_name))) == 1
        assert devices(engine, serving.active_name(service_name)) != held  # the other GPU
        # The host is full now: a second job (or server) is refused before it starts, naming both holders.
        late = job("late")
        with pytest.raises(GpusBusy, match=r"GPU 0 .* by container gpuferry-(job|serve)-.*GPU 1 .* by container "
                                           r"gpuferry-(job|serve)-.*Free: none"):  # fmt: skip
            compute.submit(late)
        assert engine.containers.list(all=True, filters={"label": f"io.gpuferry.job-key={late.key}"}) == []
        with pytest.raises(GpusBusy, match=r"by container gpuferry-job-"):
            serving.deploy(spec(model, gpus=2), release("2", images[0], model))
        assert serving.current(service_name)["version"] == "1"
    finally:
        compute.cancel(handle)
        compute.watch(handle, timeout_seconds=300)
