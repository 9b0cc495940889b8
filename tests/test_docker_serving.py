"""DockerServing against the registry stack's podman (`make registry-up`), with stand-in GPUs.

The regressor example trains in its image with DockerCompute; its MLflow model is then served by gpuferry's
model server from the same image, on GPUs chosen as for training jobs. A second version replaces the first
only once it is ready and answered the smoke request; a version whose image cannot serve is removed while the
first keeps answering.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.base.serving import DeployOutcome, Release
from blocks.base.storage import write_manifest
from blocks.docker.compute import DockerCompute
from blocks.docker.gpu_alloc import GpusBusy
from blocks.docker.serving import DockerServing
from blocks.errors import ConfigurationError, DeployFailed
from blocks.local.provider import LocalMachine
from blocks.records import ImageRef, ServerSpec, TrainingJob
from blocks.specs import Resources, ServingSpec
from tests.fake_gpus import FakeGpus, fake_gpus
from tests.test_docker_compute import credentials, engine, stack  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TINY_WORKLOAD = (
    "name: tiny\nimage: {dockerfile: Dockerfile}\ntrain: {command: [sh, -c, 'true']}\n"
    "promotion: {metric: m}\nserve: {command: [sh, -c, 'true'], port: 8080}\n"
)


@pytest.fixture(scope="module")
def gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGpus]:
    with fake_gpus(tmp_path_factory.mktemp("gpus"), count=2) as fake:
        yield fake


def _builder(stack: dict[str, str], repository: str, base: str):  # a DockerImageBuilder
    from blocks.docker.image import DockerImageBuilder

    return DockerImageBuilder(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        credentials=credentials(stack),
        repository=repository,
        build_args={"BASE_IMAGE": base, "BASE": base},
    )


@pytest.fixture(scope="module")
def images(
    stack: dict[str, str], engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ImageRef, ImageRef]]:
    """(the regressor's image, an image without Python: gpuferry's server cannot start in it)."""
    from blocks.workload.source import load_workload
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
            with contextlib.suppress(docker.errors.APIError):
                engine.images.remove(local.id, force=True)


def _inventory(gpus: FakeGpus) -> list:
    return LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent").host_inventory()


@pytest.fixture(scope="module")
def model(
    stack: dict[str, str], gpus: FakeGpus, images: tuple[ImageRef, ImageRef], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict]:
    """The regressor trained in its image (DockerCompute), stored as a checkpoint with its manifest."""
    root = tmp_path_factory.mktemp("train")
    c = DockerCompute(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        registry_credentials=credentials(stack),
        cdi_kind=gpus.kind,
        workdir_root=str(root),
    ).with_inventory(_inventory(gpus))
    key = f"t{uuid.uuid4().hex[:8]}-regressor"
    job = TrainingJob(
        key=key,
        workdir=c.job_workdir(key),
        image=images[0],
        command=["python", "train.py"],
        env={"HPARAMS": json.dumps({"alpha": 0.05})},
        resources=Resources(time_limit_minutes=10),
    )
    handle = c.submit(job)
    status = c.watch(handle, timeout_seconds=600)
    final = Path(c.result(handle, status).checkpoint_dir) / "final"
    write_manifest(final)
    return final.as_uri(), json.loads((final / "serving_input_example.json").read_text())


@pytest.fixture
def serving(stack: dict[str, str], gpus: FakeGpus) -> Iterator[DockerServing]:
    block = DockerServing(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        registry_credentials=credentials(stack),
        cdi_kind=gpus.kind,
        health_interval_seconds=2,
        drain_seconds=10,
        env={"WARMUP_ITERATIONS": "1"},
    ).with_inventory(_inventory(gpus))
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


class SteadyLoad:
    """Clients asking the service's address without pause: half on keep-alive connections, half on a new
    connection per request. ``answers``: (when the request started, status; 0: no answer)."""

    def __init__(self, url: str, request: dict, clients: int = 4) -> None:
        self.url, self.request = url, request
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(i % 2 == 0,)) for i in range(clients)]

    def _ask(self, keep_alive: bool) -> None:
        client = httpx.Client(timeout=30) if keep_alive else None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                post = client.post if client is not None else httpx.post
                status = post(f"{self.url}/invocations", json=self.request, timeout=30).status_code
            except httpx.HTTPError:
                status = 0
            self.answers.append((started, status))
            self._stop.wait(0.02)  # about 40 requests a second from each client: steady, not a flood
        if client is not None:
            client.close()

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        wait_for(lambda: len(self.answers) >= 20)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def after(self, moment: float) -> int:
        return sum(1 for started, _ in self.answers if started > moment)


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_deploy_switch_and_a_bad_image_leaves_the_old_one_serving(
    serving: DockerServing,
    images: tuple[ImageRef, ImageRef],
    model: tuple[str, dict],
    engine: docker.DockerClient,
) -> None:
    good, bad = images
    first = serving.deploy(spec(model, gpu_devices=["1"]), release("1", good, model))
    assert first.model_version == "1" and first.previous_version is None
    assert predict(first.url, model[1]) == 200
    active, front = serving.active_name(service_name), serving.front_name(service_name)
    assert first.url != first.detail["version_url"] and predict(first.detail["version_url"], model[1]) == 200
    assert devices(engine, active) == ["nvidia1"]  # the GPU asked for by index, nothing else
    assert devices(engine, front) == []  # the front holds no GPU
    info = engine.api.inspect_container(active)
    assert info["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert info["Config"]["Healthcheck"]["Test"][:2] == ["CMD", "python"]  # the engine's own check of /healthz
    now = serving.current(service_name)
    assert now is not None and now["version"] == "1" and now["url"] == first.url
    # The same version again changes nothing.
    again = serving.deploy(spec(model, gpu_devices=["1"]), release("1", good, model))
    assert again.detail["changed"] is False and again.url == first.url

    # A version whose image cannot serve: removed; the service's address answered every request all along.
    with SteadyLoad(first.url, model[1]) as load:
        with pytest.raises(DeployFailed, match=r"v2 of .* was removed, v1 keeps serving: ") as caught:
            serving.deploy(spec(model, gpus=1), release("2", bad, model))
        failed = time.monotonic()
        wait_for(lambda: load.after(failed) >= 20)
    assert "exited (exit code 127) before it was ready" in str(caught.value)
    assert "python: not found" in str(caught.value)  # the tail of its log comes with the error
    assert {status for _, status in load.answers} == {200}, load.answers
    assert serving.current(service_name)["version"] == "1"
    assert sorted(
        c.name for c in engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service_name}"})
    ) == sorted([active, front])
    tags = DeployOutcome.from_error(release("2", bad, model), caught.value).tags()
    assert tags["deploy.status"] == "failed" and tags["deploy.failed_version"] == "2"
    assert tags["deploy.reason"].startswith("DeployFailed: v2 of")

    # A good v2 by count: a free GPU (not v1's), ready and answering before the front moves to it. The service's
    # address stays and loses no request on the way, on keep-alive connections and new ones alike.
    with SteadyLoad(first.url, model[1]) as load:
        second = serving.deploy(spec(model, gpus=1), release("2", good, model))
        switched = time.monotonic()
        wait_for(lambda: load.after(switched) >= 20)  # v1 is gone by now: these reached v2
    assert {status for _, status in load.answers} == {200}, [a for a in load.answers if a[1] != 200][:5]
    assert second.previous_version == "1" and second.url == first.url
    assert predict(first.detail["version_url"], model[1]) == 0  # v1 drained and gone
    assert devices(engine, active) == ["nvidia0"]
    assert serving.current(service_name)["version"] == "2"
    tags = DeployOutcome.deployed(release("2", good, model), second).tags()
    assert tags["deploy.status"] == "deployed" and tags["deploy.backend"] == "gpuferry-docker-serving"
    assert tags["deploy.endpoint"] == second.url == first.url and tags["deploy.previous_version"] == "1"


def test_a_front_that_cannot_reach_the_new_version_goes_back_to_the_old_one(
    serving: DockerServing,
    images: tuple[ImageRef, ImageRef],
    model: tuple[str, dict],
    engine: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new version answered on its own port, but not through the front (made so here: the readiness check
    through the front never succeeds): the front is pointed back at v1, v2 is removed, no request is lost."""
    import blocks.docker.front as front_module
    import blocks.docker.serving as module

    first = serving.deploy(spec(model), release("1", images[0], model))
    real_ready = module.is_ready

    def not_through_the_front(url: str, path: str = "/readyz") -> bool:
        return url != first.url and real_ready(url, path)

    for patched in (module, front_module):  # the front's own check (front.py) and the backend's
        monkeypatch.setattr(patched, "is_ready", not_through_the_front)
    impatient = serving.model_copy(update={"front_ready_seconds": 3})
    with SteadyLoad(first.url, model[1]) as load:
        with pytest.raises(
            DeployFailed,
            match=r"v2 of .* was removed, v1 keeps serving: the service's front "
            r"gpuferry-front-.* did not answer /readyz through to v2-",
        ):
            impatient.deploy(spec(model), release("2", images[0], model))
        failed = time.monotonic()
        wait_for(lambda: load.after(failed) >= 20)
    assert {status for _, status in load.answers} == {200}, [a for a in load.answers if a[1] != 200][:5]
    front = engine.containers.get(serving.front_name(service_name))
    v1 = engine.containers.get(serving.active_name(service_name))
    assert (
        front.exec_run(["cat", "/tmp/gpuferry-front/target"]).output.decode().strip()
        == v1.labels["io.gpuferry.front-target"]
    )
    assert serving.current(service_name)["version"] == "1"
    assert sorted(
        c.name for c in engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={service_name}"})
    ) == sorted([front.name, v1.name])


def test_gpus_the_host_lacks_or_that_others_hold_fail_before_a_container_starts(
    serving: DockerServing,
    images: tuple[ImageRef, ImageRef],
    model: tuple[str, dict],
    engine: docker.DockerClient,
) -> None:
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
    serving: DockerServing,
    stack: dict[str, str],
    gpus: FakeGpus,
    images: tuple[ImageRef, ImageRef],
    model: tuple[str, dict],
    engine: docker.DockerClient,
    tmp_path: Path,
) -> None:
    """Training and serving choose from one record, the engine's labels: neither takes the other's GPU."""
    compute = DockerCompute(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        cdi_kind=gpus.kind,
        registry_credentials=credentials(stack),
        workdir_root=str(tmp_path / "jobs"),
        stop_timeout_seconds=5,
    ).with_inventory(_inventory(gpus))
    assert isinstance(compute, DockerCompute)

    def job(name: str) -> TrainingJob:
        key = f"t{uuid.uuid4().hex[:8]}-{name}"
        return TrainingJob(
            key=key,
            workdir=compute.job_workdir(key),
            image=images[0],
            command=["python", "-c", "import time; time.sleep(900)"],
            resources=Resources(time_limit_minutes=20, gpus_per_node=1),
        )

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
        with pytest.raises(
            GpusBusy,
            match=r"GPU 0 .* by container gpuferry-(job|serve)-.*GPU 1 .* by container "
            r"gpuferry-(job|serve)-.*Free: none",
        ):
            compute.submit(late)
        assert engine.containers.list(all=True, filters={"label": f"io.gpuferry.job-key={late.key}"}) == []
        with pytest.raises(GpusBusy, match=r"by container gpuferry-job-"):
            serving.deploy(spec(model, gpus=2), release("2", images[0], model))
        assert serving.current(service_name)["version"] == "1"
    finally:
        compute.cancel(handle)
        compute.watch(handle, timeout_seconds=300)
