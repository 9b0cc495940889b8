"""DockerCompute against the registry stack's podman (`make registry-up`), with stand-in GPUs.

The digits example's image (built with DockerImageBuilder on the stack's base, a probe added) trains in
containers that get stand-in GPUs through a CDI spec naming them by index and by UUID (tests/fake_gpus.py),
chosen from the inventory LocalMachine reads with an nvidia-smi that reports them. Each test asserts what the
container saw: its /dev/nvidia* nodes and the variables the CDI spec and the backend set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import docker
import pytest
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost

from blocks.base.mlflow_model import check_mlflow_model
from blocks.docker.compute import DockerCompute
from blocks.docker.engine import Engine
from blocks.docker.gpu_alloc import GpusBusy
from blocks.errors import ConfigurationError, JobFailed
from blocks.local.provider import LocalMachine
from blocks.records import ImageRef, TrainingJob
from blocks.specs import Resources
from tests.fake_gpus import FakeGpus, fake_gpus
from tests.stacks import stack_env

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent

# What the container sees, written to the job's directory; then the job's mode: train (digits' train.py, as
# PID 1), wait (until the test creates `release` in the job's directory), hog (memory until killed).
PROBE = """\
import glob, json, os, sys, time
work = os.path.dirname(os.environ["CHECKPOINT_DIR"])
seen = {"devices": sorted(glob.glob("/dev/nvidia*")), "cwd": os.getcwd(), "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("FAKE_", "CUDA_", "NVIDIA_", "API_", "HPARAMS"))}}
with open(os.path.join(work, "probe.json.tmp"), "w") as f:
    json.dump(seen, f)
os.replace(os.path.join(work, "probe.json.tmp"), os.path.join(work, "probe.json"))
mode = sys.argv[1]
if mode == "train":
    os.execv(sys.executable, [sys.executable, "train.py"])
if mode == "wait":
    deadline = time.monotonic() + 900
    while not os.path.exists(os.path.join(work, "release")) and time.monotonic() < deadline:
        time.sleep(0.2)
    print("released", flush=True)
if mode == "hog":
    chunks = []
    while True:
        chunks.append(bytearray(16 << 20))
"""


@pytest.fixture(scope="module")
def stack() -> dict[str, str]:
    env = stack_env("registry")
    env["REGISTRY_PASSWORD"] = Path(env["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    return env


def credentials(stack: dict[str, str]) -> DockerRegistryCredentials:
    return DockerRegistryCredentials(
        username=stack["REGISTRY_USER"],
        password=stack["REGISTRY_PASSWORD"],
        registry_url=f"http://{stack['REGISTRY_URL']}",
    )


@pytest.fixture(scope="module")
def engine(stack: dict[str, str]) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=stack["DOCKER_HOST"], timeout=600)
    yield client
    client.close()


@pytest.fixture(scope="module")
def gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGpus]:
    with fake_gpus(tmp_path_factory.mktemp("gpus"), count=4) as fake:
        yield fake


@pytest.fixture(scope="module")
def image(
    stack: dict[str, str], engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ImageRef]:
    """The digits example's image with the probe, pushed; the local copies this module made are removed after."""
    from blocks.docker.image import DockerImageBuilder
    from blocks.workload.source import load_workload
    from tests.examples import DIGITS

    context = tmp_path_factory.mktemp("image") / "digits"
    shutil.copytree(DIGITS, context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (context / "probe.py").write_text(PROBE)
    builder = DockerImageBuilder(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        credentials=credentials(stack),
        repository="gpuferry-test/docker-compute",
        build_args={"BASE_IMAGE": stack["BASE_IMAGE"]},
    )
    ref = builder.build(load_workload(str(context)))
    assert ref.reference and "@sha256:" in ref.reference and ref.workdir == "/workload"
    yield ref
    for local in engine.images.list(name=builder.image_name()):
        try:
            # Not forced: podman's forced removal also removes every container of the image, which would kill
            # the jobs of another test run on the same engine.
            engine.images.remove(local.id)
        except docker.errors.APIError:
            pass  # still used by a container (another test left it, or another run is using it)


def compute(stack: dict[str, str], gpus: FakeGpus, root: Path, **fields: object) -> DockerCompute:
    """The backend with the host's inventory as the stack's provider reads it (LocalMachine, nvidia-smi); on the
    stack's socket unless ``fields`` name another docker_host."""
    fields.setdefault("docker_host", DockerHost(base_url=stack["DOCKER_HOST"]))
    block = DockerCompute(
        registry_credentials=credentials(stack),
        cdi_kind=gpus.kind,
        workdir_root=str(root / "jobs"),
        poll_interval_start=0.25,
        poll_interval_max=2.0,
        stop_timeout_seconds=60,
        **fields,
    )
    nodes = LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent").host_inventory()
    with_gpus = block.with_inventory(nodes)
    assert isinstance(with_gpus, DockerCompute) and with_gpus.gpu_inventory is not None
    return with_gpus


@pytest.fixture
def keys(engine: docker.DockerClient) -> Iterator[list[str]]:
    """Job keys a test makes; their containers are removed at its end whatever happened."""
    made: list[str] = []
    yield made
    for key in made:
        for container in engine.containers.list(all=True, filters={"label": f"io.gpuferry.job-key={key}"}):
            container.remove(force=True)


def make_job(
    c: DockerCompute,
    ref: ImageRef,
    keys: list[str],
    name: str,
    mode: str = "train",
    hparams: dict | None = None,
    **resources: object,
) -> TrainingJob:
    key = f"t{uuid.uuid4().hex[:8]}-{name}"
    keys.append(key)
    return TrainingJob(
        key=key,
        workdir=c.job_workdir(key),
        image=ref,
        command=["python", "probe.py", mode],
        env={
            "HPARAMS": json.dumps(hparams or {"epochs": 2, "hidden": 16}),
            "CHECKPOINT_EVERY": "10",
            "OMP_NUM_THREADS": "1",
        },
        resources=Resources(time_limit_minutes=20, **resources),
    )


def probe(job: TrainingJob, timeout: float = 600) -> dict:
    path = Path(job.workdir) / "probe.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"the job never wrote {path}"
        time.sleep(0.2)
    return json.loads(path.read_text())


def containers_of(engine: docker.DockerClient, key: str) -> list:
    return engine.containers.list(all=True, filters={"label": f"io.gpuferry.job-key={key}"})


@pytest.mark.parametrize("by", ["indices", "uuids"])
def test_trains_in_the_image_on_the_gpus_asked_for(
    by: str,
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    c = compute(stack, gpus, tmp_path)
    devices = ["0", "2"] if by == "indices" else [gpus.uuids[3], gpus.uuids[1]]
    job = make_job(c, image, keys, by, gpu_devices=devices, mem_gb=2)
    handle = c.submit(job)
    lines: list[str] = []
    progress: list[dict] = []
    status = c.watch(handle, on_output=lines.append, on_progress=progress.append, timeout_seconds=900)
    assert status.state == "COMPLETED", c.log_tail(handle)
    result = c.result(handle, status)

    seen = probe(job)
    want = [0, 2] if by == "indices" else [1, 3]
    assert seen["devices"] == [f"/dev/nvidia{i}" for i in want]  # exactly the chosen devices, nothing else
    assert {k: v for k, v in seen["env"].items() if k.endswith("_UUID")} == {
        gpus.env_name(i): gpus.uuids[i] for i in want
    }  # the CDI spec's own edits for those devices
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and seen["env"]["FAKE_GPU_DRIVER"] == "gpuferry-test"
    assert seen["cwd"] == "/workload" and seen["pid"] == 1  # the image's code; signals reach the job itself
    assert check_mlflow_model(Path(result.checkpoint_dir) / "final").pyfunc
    assert progress and progress[-1]["step"] == progress[-1]["total_steps"]
    text = "".join(lines)
    assert "val_accuracy" in text or "step" in text, text[-2000:]
    # Once ended: the log and the end are in the job's directory, the container is gone.
    assert (Path(job.workdir) / "job.log").read_text().count("\n") >= len(text.splitlines())
    assert json.loads((Path(job.workdir) / "exit.json").read_text())["state"] == "COMPLETED"
    assert containers_of(engine, job.key) == []
    assert c.read_log(handle)[0] == text  # the same output, read back from the saved log


def test_two_jobs_get_disjoint_gpus_and_a_third_that_does_not_fit_never_starts(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    c = compute(stack, gpus, tmp_path)
    jobs = [make_job(c, image, keys, f"pair{i}", "wait", gpus_per_node=2) for i in range(2)]
    handles: list = [None, None]
    errors: list[BaseException] = []

    def submit(i: int) -> None:
        try:
            handles[i] = c.model_copy().submit(jobs[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    seen = [set(probe(j)["devices"]) for j in jobs]
    assert len(seen[0]) == 2 and len(seen[1]) == 2 and not seen[0] & seen[1], seen
    assert seen[0] | seen[1] == {f"/dev/nvidia{i}" for i in range(4)}

    third = make_job(c, image, keys, "third", "wait", gpus_per_node=1)
    with pytest.raises(GpusBusy, match=r"cannot give 1 GPU\(s\) now: GPU 0 .* by container gpuferry-job-.*Free: none"):
        c.submit(third)
    assert containers_of(engine, third.key) == [] and not (Path(third.workdir) / "docker-job.json").exists()
    with pytest.raises(ConfigurationError, match=r"asks for 5 GPU\(s\) but Docker host .* has 4: 0 \(GPU-"):
        c.submit(make_job(c, image, keys, "five", "wait", gpus_per_node=5))
    with pytest.raises(ConfigurationError, match=r"names 'GPU-nope'.*does not have; it has 4 GPU\(s\)"):
        c.submit(make_job(c, image, keys, "nope", "wait", gpu_devices=["GPU-nope"]))

    for job in jobs:
        (Path(job.workdir) / "release").touch()
    for handle in handles:
        assert c.watch(handle, timeout_seconds=600).state == "COMPLETED", c.log_tail(handle)
    # The GPUs are free again: the third one runs now.
    (Path(third.workdir)).mkdir(parents=True, exist_ok=True)
    (Path(third.workdir) / "release").touch()
    handle = c.submit(third)
    assert c.watch(handle, timeout_seconds=600).state == "COMPLETED", c.log_tail(handle)


def test_two_jobs_that_both_share_get_the_same_gpu_and_one_that_does_not_cannot(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    c = compute(stack, gpus, tmp_path)
    pair = [make_job(c, image, keys, f"share{i}", "wait", gpu_devices=["1"], share_gpus=True) for i in range(2)]
    handles = [c.submit(job) for job in pair]
    seen = [probe(job) for job in pair]
    assert seen[0]["devices"] == seen[1]["devices"] == ["/dev/nvidia1"]  # both at once, on the same device
    assert all(s["env"][gpus.env_name(1)] == gpus.uuids[1] for s in seen)
    assert [x.status for job in pair for x in containers_of(engine, job.key)] == ["running", "running"]
    # One that does not share is refused GPU 1, naming the two that hold it; by count it gets a free GPU.
    with pytest.raises(GpusBusy, match=r"cannot give gpu_devices \['1'\] now: GPU 1 .* by container ") as busy:
        c.submit(make_job(c, image, keys, "alone", "wait", gpu_devices=["1"]))
    for job in pair:
        assert f"container gpuferry-job-{job.key} (sharing)" in str(busy.value)
    alone = make_job(c, image, keys, "alone-count", "wait", gpus_per_node=1)
    alone_handle = c.submit(alone)
    assert probe(alone)["devices"] == ["/dev/nvidia0"]  # the lowest free one, never the shared GPU 1
    # A sharing request cannot join a GPU whose holder does not share.
    with pytest.raises(GpusBusy, match=r"GPU 0 .* by container gpuferry-job-.*-alone-count\..*they do not share"):
        c.submit(make_job(c, image, keys, "share-late", "wait", gpu_devices=["0"], share_gpus=True))

    # A job whose state file is lost is adopted by its label, with the GPUs the label says it holds.
    state_file = Path(pair[0].workdir) / "docker-job.json"
    state_file.unlink()
    assert c.submit(pair[0]).job_id == handles[0].job_id
    assert json.loads(state_file.read_text())["gpus"] == [f"1 ({gpus.uuids[1]}, NVIDIA Fake-80GB)"]
    assert len(containers_of(engine, pair[0].key)) == 1

    for job in [*pair, alone]:
        (Path(job.workdir) / "release").touch()
    for handle in [*handles, alone_handle]:
        assert c.watch(handle, timeout_seconds=600).state == "COMPLETED", c.log_tail(handle)


def test_two_submits_from_two_machines_at_once_end_on_disjoint_gpus(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    tmp_path: Path,
    keys: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No machine-wide lock between them (as for flows on two machines): both choose GPUs 0-1 from the same
    claims; the container created later sees the earlier one's claim, is removed, and chooses again."""
    c = compute(stack, gpus, tmp_path)
    monkeypatch.setattr(Engine, "machine_lock", lambda self: nullcontext())
    barrier = threading.Barrier(2, timeout=300)
    real_claims = Engine.gpu_claims
    first_call = threading.local()

    def claims_then_meet(self: Engine) -> list:
        found = real_claims(self)
        if not getattr(first_call, "done", False):  # each thread's first look: both see no claim
            first_call.done = True
            barrier.wait()
        return found

    monkeypatch.setattr(Engine, "gpu_claims", claims_then_meet)
    removed: list[str] = []
    real_remove = Engine.remove

    def remove(self: Engine, container: str) -> None:
        removed.append(container)
        real_remove(self, container)

    monkeypatch.setattr(Engine, "remove", remove)
    jobs = [make_job(c, image, keys, f"race{i}", "wait", gpus_per_node=2) for i in range(2)]
    handles: list = [None, None]

    def submit(i: int) -> None:
        handles[i] = c.model_copy(update={"docker_host": DockerHost(base_url=stack["DOCKER_HOST"])}).submit(jobs[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    seen = [set(probe(j)["devices"]) for j in jobs]
    assert len(seen[0]) == len(seen[1]) == 2 and not seen[0] & seen[1], seen
    assert len(removed) == 1  # the later of the two first containers lost, was removed, and chose again
    for job in jobs:
        (Path(job.workdir) / "release").touch()
    for handle in handles:
        assert c.watch(handle, timeout_seconds=600).state == "COMPLETED"


SUBMITTER = """
import json, sys
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost
from blocks.docker.compute import DockerCompute
from blocks.records import TrainingJob
args = json.load(open(sys.argv[1]))
block = DockerCompute(docker_host=DockerHost(base_url=args["base_url"]), cdi_kind=args["cdi_kind"],
                      registry_credentials=DockerRegistryCredentials(**args["credentials"]),
                      workdir_root=args["workdir_root"], gpu_inventory=args["inventory"])
job = TrainingJob.model_validate(args["job"])
handle = block.submit(job)
print("submitted", handle.job_id, flush=True)
block.watch(handle, on_output=lambda text: print(text, end="", flush=True))
"""


def test_a_retry_after_the_flow_process_was_killed_adopts_the_running_container(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    c = compute(stack, gpus, tmp_path)
    job = make_job(c, image, keys, "adopt", hparams={"epochs": 40, "batch_size": 16, "hidden": 16}, gpus_per_node=1)
    args = {
        "base_url": stack["DOCKER_HOST"],
        "cdi_kind": gpus.kind,
        "workdir_root": c.workdir_root,
        "inventory": [g.model_dump() for g in c.gpu_inventory or []],
        "job": job.model_dump(mode="json"),
        "credentials": {
            "username": stack["REGISTRY_USER"],
            "password": stack["REGISTRY_PASSWORD"],
            "registry_url": f"http://{stack['REGISTRY_URL']}",
        },
    }
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(args))
    args_file.chmod(0o600)
    output = open(tmp_path / "flow.log", "w")  # noqa: SIM115 - the flow process writes to it after this returns
    flow = subprocess.Popen(
        [sys.executable, "-c", SUBMITTER, str(args_file)],
        cwd=REPO,
        stdout=output,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    output.close()
    deadline = time.monotonic() + 600
    while (c.read_progress(c._handle(job.key, Path(job.workdir))) or {}).get("step", 0) < 5:
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.5)
    flow.send_signal(signal.SIGKILL)  # the flow's process dies while the container trains
    flow.wait(60)
    assert [x.status for x in containers_of(engine, job.key)] == ["running"]

    handle = c.submit(job)  # the retried task
    assert handle.job_id == f"gpuferry-job-{job.key}"
    assert len(containers_of(engine, job.key)) == 1  # adopted, not started again
    status = c.watch(handle, timeout_seconds=900)
    assert status.state == "COMPLETED", c.log_tail(handle)
    assert c.result(handle, status).requeues == 0
    log, _ = c.read_log(handle)
    assert "resumed from" not in log  # one run from start to end: the same container all along


def test_a_stop_checkpoints_and_the_restarted_container_resumes(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
) -> None:
    c = compute(stack, gpus, tmp_path)
    job = make_job(
        c, image, keys, "resume", hparams={"epochs": 40, "batch_size": 16, "hidden": 16}, gpu_devices=[gpus.uuids[2]]
    )
    handle = c.submit(job)
    deadline = time.monotonic() + 600
    while (c.read_progress(handle) or {}).get("step", 0) < 30:
        assert time.monotonic() < deadline, c.log_tail(handle)
        time.sleep(0.5)
    # What a host's admin (or a drain) does: docker stop — SIGTERM, SIGKILL after the grace period.
    engine.containers.get(handle.job_id).stop(timeout=120)
    status = c.watch(handle, timeout_seconds=900)
    log, _ = c.read_log(handle)
    assert status.state == "COMPLETED", log[-3000:]
    saved = [int(m) for m in re.findall(r"preempted: saved checkpoint at step (\d+)/", log)]
    resumed = [int(m) for m in re.findall(r"resumed from step-\d+: step (\d+),", log)]
    assert len(saved) == 1 and resumed == saved, log[-3000:]
    assert c.result(handle, status).requeues == 1
    assert probe(job)["devices"] == ["/dev/nvidia2"]  # the same GPU after the restart
    assert (Path(job.workdir) / "checkpoints" / "final" / "MLmodel").exists()


def test_cancel_stops_the_job_for_good(
    stack: dict[str, str], gpus: FakeGpus, image: ImageRef, engine: docker.DockerClient, tmp_path: Path, keys: list[str]
) -> None:
    c = compute(stack, gpus, tmp_path)
    job = make_job(c, image, keys, "cancel", hparams={"epochs": 200, "batch_size": 16, "hidden": 16}, gpus_per_node=1)
    handle = c.submit(job)
    deadline = time.monotonic() + 600
    while (c.read_progress(handle) or {}).get("step", 0) < 5:
        assert time.monotonic() < deadline, c.log_tail(handle)
        time.sleep(0.5)
    c.cancel(handle)
    status = c.watch(handle, timeout_seconds=300)
    assert status.state == "CANCELLED", status
    assert "preempted: saved checkpoint at step" in c.read_log(handle)[0]  # SIGTERM reached it: it checkpointed
    assert containers_of(engine, job.key) == [] and c._requeues(handle) == 0


def test_a_sweep_runs_as_an_array_of_containers_each_task_on_gpus_of_its_own(
    stack: dict[str, str], gpus: FakeGpus, image: ImageRef, engine: docker.DockerClient, tmp_path: Path, keys: list[str]
) -> None:
    """Three configurations, two at a time, one GPU each: held until released, each task a container of its own
    with its own settings and GPU (from the allocator), started by the watch's polls; a retry adopts the array."""
    c = compute(stack, gpus, tmp_path)
    job = make_job(c, image, keys, "sweep", gpus_per_node=1)
    keys.extend(f"{job.key}-task-{i}" for i in range(3))
    handle = c.submit_held_sweep(job, 3, parallelism=2)
    assert c.submit_held_sweep(job, 3, parallelism=2) == handle  # adopted by its key, not queued twice
    assert c.poll([handle])[handle.job_id].state == "PENDING" and not containers_of(engine, f"{job.key}-task-0")
    settings = {i: {"HPARAMS": json.dumps({"epochs": 1, "hidden": 8 * (i + 1)})} for i in range(3)}
    c.release_sweep_tasks(handle, {0: settings[0]})
    c.release_sweep_tasks(handle, {1: settings[1], 2: settings[2]}, whole_array=True)
    status = c.watch(handle, timeout_seconds=900)
    assert status.state == "COMPLETED", status
    outcome = c.array_outcome(handle, 3)
    assert [outcome[i][0].state for i in range(3)] == ["COMPLETED"] * 3, outcome
    seen = [json.loads((Path(c.task_dir(job.workdir, i)) / "probe.json").read_text()) for i in range(3)]
    assert [s["env"]["HPARAMS"] for s in seen] == [settings[i]["HPARAMS"] for i in range(3)]
    assert all(len(s["devices"]) == 1 for s in seen), seen  # one GPU each, as asked
    for i in range(3):
        assert check_mlflow_model(Path(c.task_dir(job.workdir, i)) / "checkpoints" / "final").pyfunc
        assert containers_of(engine, f"{job.key}-task-{i}") == []  # each removed once it ended


def test_out_of_memory_is_an_actionable_error(
    stack: dict[str, str], gpus: FakeGpus, image: ImageRef, engine: docker.DockerClient, tmp_path: Path, keys: list[str]
) -> None:
    c = compute(stack, gpus, tmp_path, keep_finished_containers=True)
    job = make_job(c, image, keys, "oom", "hog", mem_gb=0.25, gpus_per_node=4)
    handle = c.submit(job)
    status = c.watch(handle, timeout_seconds=600)
    assert status.state == "OUT_OF_MEMORY" and status.exit_code == 137, status
    # The kernel's memory cgroup killed it; podman here does not report OOMKilled (Docker does): both say so.
    with pytest.raises(JobFailed, match=r"exceeding its memory limit \(256 MiB.*raise resources.mem_gb") as caught:
        c.result(handle, status)
    assert caught.value.state == "OUT_OF_MEMORY"
    # Kept for inspection, its end recorded: it holds no GPU any more, so a job that needs all four starts.
    # podman says "stopped" until its cleanup of the ended container has run, then "exited": both are ended.
    assert [x.status for x in containers_of(engine, job.key)] in (["exited"], ["stopped"])
    after = make_job(c, image, keys, "after-oom", "wait", gpus_per_node=4)
    (Path(after.workdir)).mkdir(parents=True)
    (Path(after.workdir) / "release").touch()
    assert c.watch(c.submit(after), timeout_seconds=600).state == "COMPLETED"


def test_the_docker_api_path_and_secrets_through_a_0600_file(
    stack: dict[str, str],
    gpus: FakeGpus,
    image: ImageRef,
    engine: docker.DockerClient,
    tmp_path: Path,
    keys: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Docker Engine API's create (podman's Docker-compatible one: no GPUs there), a variable passed by name:
    its value reaches the job through the 0600 file, never the container's configuration."""
    token = f"tok en '$HOME' {uuid.uuid4().hex}"
    monkeypatch.setenv("API_TOKEN", token)
    c = compute(stack, gpus, tmp_path, api="docker", pass_env=["API_TOKEN"])
    job = make_job(c, image, keys, "dockerapi", "wait")
    handle = c.submit(job)
    seen = probe(job)
    assert seen["env"]["API_TOKEN"] == token
    assert seen["devices"] == [] and seen["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    secret = Path(job.workdir) / ".secret.env"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    config = engine.api.inspect_container(handle.job_id)["Config"]
    assert token not in json.dumps(config) and "API_TOKEN" not in json.dumps(config["Env"])
    (Path(job.workdir) / "release").touch()
    assert c.watch(handle, timeout_seconds=600).state == "COMPLETED", c.log_tail(handle)
    assert not secret.exists()  # gone once the job ended
    assert token not in (Path(job.workdir) / "job.log").read_text()


def test_a_job_without_an_image_or_on_two_nodes_is_refused_before_anything_runs(
    stack: dict[str, str], gpus: FakeGpus, tmp_path: Path
) -> None:
    c = compute(stack, gpus, tmp_path)
    job = TrainingJob(key="t-noimage", workdir=c.job_workdir("t-noimage"), command=["python", "train.py"])
    with pytest.raises(ConfigurationError, match="runs the job in the workload's image, and the job has none"):
        c.submit(job)
    pinned = ImageRef(builder="x", content_tag="x", reference="registry.example/x:latest")
    with pytest.raises(ConfigurationError, match="is not pinned by digest"):
        c.validate_job(job.model_copy(update={"image": pinned}))
    two = job.model_copy(
        update={
            "image": pinned.model_copy(update={"reference": "r.example/x@sha256:" + "0" * 64}),
            "resources": Resources(nodes=2),
        }
    )
    with pytest.raises(ConfigurationError, match="resources.nodes=2: the Docker backend runs a job on one host"):
        c.validate_job(two)
    assert not Path(job.workdir).exists()


def test_the_check_of_a_docker_host_reads_its_engine_gpus_and_pull_login(stack: dict[str, str]) -> None:
    """``gpuferry check`` on DockerCompute and DockerServing: which engine answers, the GPUs it offers (the inventory
    the block knows; none in use), whether the engine takes the pull login (wrong password: a failed row naming
    the field), the services a serving host runs. Nothing is created."""
    from blocks.checks import Probe
    from blocks.docker.serving import DockerServing
    from blocks.records import GpuInfo

    def rows(block: DockerCompute | DockerServing) -> dict[str, tuple[str, str, str]]:
        probe = Probe("compute", type(block).__name__, timeout=60, needs_image=True)
        block.self_check(probe)
        return {r.check: (r.status, r.detail, r.fix) for r in probe.rows}

    host = {"docker_host": DockerHost(base_url=stack["DOCKER_HOST"]), "registry_credentials": credentials(stack)}
    inventory = [
        GpuInfo(index=i, name="NVIDIA H200", memory_mib=143771, driver_version="580", uuid=f"GPU-{i}") for i in range(2)
    ]
    compute = rows(DockerCompute(**host, gpu_inventory=inventory))
    assert [(k, v[0]) for k, v in compute.items()] == [("engine", "ok"), ("GPUs", "ok"), ("registry login", "ok")]
    assert compute["engine"][1].lower().startswith("podman ") and "libpod API" in compute["engine"][1], compute
    assert (
        compute["GPUs"][1].startswith("0 (GPU-0, NVIDIA H200); 1 (GPU-1")
        and "GPUs reach containers by cdi" in compute["GPUs"][1]
    )
    assert stack["REGISTRY_USER"] in compute["registry login"][1]

    wrong = DockerRegistryCredentials(**{**credentials(stack).model_dump(), "password": "not-the-password"})
    refused = rows(DockerCompute(**{**host, "registry_credentials": wrong}))["registry login"]
    assert refused[0] == "failed" and "registry_credentials" in refused[2], refused
    assert "not-the-password" not in refused[1]

    serving = rows(DockerServing(**host))
    assert serving["GPUs"][1].startswith("known at run time"), serving
    assert serving["services"][0] == "ok"

    gone = rows(DockerCompute(docker_host=DockerHost(base_url="unix:///nonexistent/podman.sock")))
    assert list(gone) == ["engine"] and gone["engine"][0] == "failed" and "docker_host.base_url" in gone["engine"][2]
