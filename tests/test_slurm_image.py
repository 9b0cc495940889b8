"""Slurm jobs inside the workload's image: pyxis, podman, apptainer.

Unit part (no cluster): golden scripts for each runtime, bad input, runtime detection, and the
generated podman launch run by bash against a recording stand-in for podman.

Integration part (`make slurm-up` + `make registry-up`): the workload image is built with
DockerImageBuilder on the stack's Debian base, pushed, and removed locally; SlurmCluster runs jobs
in it with podman on the real local Slurm, the pull authenticated by the 0600 auth file. The cluster is a
remote one (tests/stacks.py): over SSH, the jobs' directories on its own filesystem, which this machine
does not see; what a job wrote is read back through the block's session.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect_docker.credentials import DockerRegistryCredentials
from pydantic import ValidationError

from blocks.errors import ConfigurationError, JobFailed
from blocks.records import CodeRef, ImageRef, TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.slurm.containers import ENROOT_CREDENTIALS_NAME, REGISTRY_AUTH_NAME
from blocks.slurm.script import sbatch_script
from blocks.slurm.script_image import Container
from blocks.specs import Resources
from blocks.storage.s3 import S3CheckpointStore
from tests.stacks import cluster_dir, mlflow_server, registry_login, remove_on_cluster, slurm_for_images, stack_env
from tests.test_slurm_script import check_golden

REPO = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "0123456789abcdef" * 4
IMAGE = f"registry.example:5000/team/workload@{DIGEST}"
PASSWORD = "pull-secret-" + "x" * 8


def cluster(**fields: object) -> SlurmCluster:
    values: dict[str, object] = {
        "host": "login.example",
        "user": "alice",
        "workdir_root": "/shared/jobs",
        "python": "/opt/venv/bin/python",
        "account": "research",
        "registry_credentials": DockerRegistryCredentials(
            username="puller", password=PASSWORD, registry_url="https://registry.example:5000"
        ),
    }
    values.update(fields)
    return SlurmCluster(**values)


def job(reference: str = IMAGE, **resources: object) -> TrainingJob:
    return TrainingJob(
        key="run-7-train",
        workdir="/shared/jobs/run-7-train",
        command=["python", "train.py"],
        env={"HPARAMS": '{"epochs": 2}'},
        resources=Resources(**resources),
        image=ImageRef(builder="docker", content_tag="abc", reference=reference, workdir="/workload"),
        code=CodeRef(root="/home/alice/models", archive="/tmp/code.tar.gz", sha256="cd" * 32),
    )


GOLDEN_CASES = {
    "image_podman": ({"container_runtime": "podman"}, {"gpus_per_node": 2, "mem_gb": 4}),
    "image_podman_torchrun": (
        {
            "container_runtime": "podman",
            "container_mounts": ["/datasets/digits"],
            "podman_options": ["--pid=host"],
            "container_runtime_env": {"CONTAINERS_CONF": "/etc/gpuferry/containers.conf"},
        },
        {"nodes": 2, "processes_per_node": 2, "gpus_per_node": 2},
    ),
    "image_pyxis_torchrun": (
        {"container_runtime": "pyxis", "container_runtime_env": {"ENROOT_ALLOW_HTTP": "y"}},
        {"nodes": 2, "processes_per_node": 2, "gpus_per_node": 2},
    ),
    "image_pyxis": ({"container_runtime": "pyxis", "registry_credentials": None}, {}),
    "image_apptainer": ({"container_runtime": "apptainer"}, {"gpus_per_node": 1}),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_image_scripts(name: str) -> None:
    fields, resources = GOLDEN_CASES[name]
    text = cluster(**fields)._script_for_job(job(**resources))
    check_golden(name, text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert PASSWORD not in text and "puller" not in text


def test_golden_image_sweep_array() -> None:
    # An array task's own settings reach the container by name too.
    text = cluster(container_runtime="podman")._script_for_job(job(), array_size=4, parallelism=2)
    check_golden("image_podman_array", text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert 'GPUFERRY_CONTAINER_ENV+=" ${word%%=*}"' in text


@pytest.mark.parametrize("runtime", ["auto", "podman"])
def test_the_tracking_login_alone_is_sourced_from_the_secret_file(runtime: str) -> None:
    # A job whose only secrets are the tracking block's login (retrain's job against an MLflow server with a
    # login): the script sources the 0600 file, and holds no value.
    from pydantic import SecretStr

    given = job(reference=IMAGE).model_copy(
        update={
            "secret_env": {
                "MLFLOW_TRACKING_USERNAME": SecretStr("gpuferry-tests"),
                "MLFLOW_TRACKING_PASSWORD": SecretStr("tracking-" + "y" * 8),
            }
        }
    )
    if runtime == "auto":
        given = given.model_copy(update={"image": None})  # no image: the cluster's Python
    text = cluster(container_runtime=runtime)._script_for_job(given)
    assert "set -a; . /shared/jobs/run-7-train/.secret.env; set +a" in text
    assert "tracking-" + "y" * 8 not in text and "gpuferry-tests" not in text


def test_registry_login_goes_to_a_file_in_the_runtime_format() -> None:
    podman = cluster(container_runtime="podman")._container_files(job())
    auth = json.loads(podman[REGISTRY_AUTH_NAME])
    assert list(auth["auths"]) == ["registry.example:5000"]
    import base64

    assert base64.b64decode(auth["auths"]["registry.example:5000"]["auth"]).decode() == f"puller:{PASSWORD}"
    pyxis = cluster(container_runtime="pyxis")._container_files(job())
    assert pyxis[ENROOT_CREDENTIALS_NAME].decode() == f"machine registry.example login puller password {PASSWORD}\n"
    script = cluster(container_runtime="pyxis")._script_for_job(job())
    assert "export ENROOT_CONFIG_PATH=/shared/jobs/run-7-train/.enroot" in script
    # enroot wants host#repository
    assert f"--container-image=registry.example:5000#team/workload@{DIGEST}" in script
    assert cluster(container_runtime="podman", registry_credentials=None)._container_files(job()) == {}
    assert cluster(container_runtime="podman")._container_files(job(reference="")) == {}


def test_unknown_runtime_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="container_runtime"):
        cluster(container_runtime="docker")
    with pytest.raises(ConfigurationError, match="container.runtime='docker'.*pyxis, podman, apptainer"):
        sbatch_script(["python", "t.py"], workdir="/w", container=Container(image=IMAGE, runtime="docker"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "reference",
    [
        "registry.example:5000/team/workload:latest",
        "registry.example:5000/team/workload",
        "team/workload@sha256:abc",
        f"team/workload@{DIGEST}; rm -rf /",
        f"Team/Workload@{DIGEST}",
    ],
)
def test_image_not_pinned_by_digest_is_refused_before_any_connection(reference: str) -> None:
    unreachable = cluster(container_runtime="auto", host="login.invalid", port=1)  # connecting would fail otherwise
    with pytest.raises(ConfigurationError, match=r"job\.image\.reference=.*is not pinned by digest.*@sha256:"):
        unreachable.validate_job(job(reference=reference))


def test_bad_container_values_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="container.mounts"):
        cluster(container_runtime="podman", container_mounts=["relative/data"])._script_for_job(job())
    with pytest.raises(ConfigurationError, match="container.podman_options"):
        cluster(container_runtime="podman", podman_options=["--pid=host; id"])._script_for_job(job())
    with pytest.raises(ConfigurationError, match=r"--security-opt=VALUE with VALUE matching \^label="):
        cluster(container_runtime="podman", podman_options=["--security-opt=seccomp=unconfined"])._script_for_job(job())
    for widening in ("--privileged", "--volume=/:/host", "--cap-add=SYS_ADMIN", "--network=none", "--device=/dev/sda"):
        with pytest.raises(ConfigurationError, match=r"container.podman_options=.*one of --group-add, --init, --ipc"):
            cluster(container_runtime="podman", podman_options=[widening])._script_for_job(job())
    with pytest.raises(ConfigurationError, match="--init without a value"):
        cluster(container_runtime="podman", podman_options=["--init=yes"])._script_for_job(job())
    text = cluster(
        container_runtime="podman", podman_options=["--ipc=host", "--shm-size=8g", "--init"]
    )._script_for_job(job())
    assert "--ipc=host --shm-size=8g --init" in text
    with pytest.raises(ConfigurationError, match="container variable name"):
        cluster(container_runtime="podman", container_runtime_env={"BAD NAME": "x"})._script_for_job(job())
    spaced = DockerRegistryCredentials(username="u", password="has space", registry_url="r.example")
    with pytest.raises(ConfigurationError, match="whitespace"):
        cluster(container_runtime="pyxis", registry_credentials=spaced)._container_files(job())


def test_a_job_in_an_image_runs_from_the_images_code_one_without_from_the_shipped_code() -> None:
    c = cluster(container_runtime="podman")
    with pytest.raises(ConfigurationError, match="neither an image nor the workload's code"):
        c.validate_job(job(reference="").model_copy(update={"code": None}))
    text = c._script_for_job(job())
    assert "in_image python train.py &" in text and "--workdir=/workload" in text and ".code" not in text
    assert "cd /shared/jobs/run-7-train || exit 1" in text
    shipped = c._script_for_job(job(reference="").model_copy(update={"image": None}))
    assert f"cd /shared/jobs/.code/{'cd' * 12} || exit 1" in shipped and "/opt/venv/bin/python train.py &" in shipped
    with pytest.raises(ConfigurationError, match="container.workdir=None.*declare image.workdir"):
        cluster(container_runtime="apptainer")._script_for_job(
            job().model_copy(update={"image": ImageRef(builder="d", content_tag="a", reference=IMAGE)})
        )


# ---- runtime detection on the login node (local=True, stand-in commands on PATH) ------------------------


def _stand_ins(tmp_path: Path, srun_help: str, tools: tuple[str, ...]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "srun-calls"
    (bin_dir / "srun").write_text(f"#!/bin/sh\necho x >> {calls}\necho {json.dumps(srun_help)}\n")
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    (bin_dir / "sh").symlink_to("/bin/sh")  # PATH holds only these: the machine's own podman stays out
    return bin_dir


@pytest.mark.parametrize(
    ("srun_help", "tools", "expected"),
    [
        ("  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH", ("podman",), "pyxis"),
        ("  --container=PATH  Path to OCI container bundle", ("podman", "apptainer"), "podman"),
        ("  --container=PATH", ("apptainer",), "apptainer"),
    ],
)
def test_auto_detects_the_runtime_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, srun_help: str, tools: tuple[str, ...], expected: str
) -> None:
    monkeypatch.setenv("PATH", str(_stand_ins(tmp_path, srun_help, tools)))
    c = cluster(local=True, container_runtime="auto")
    assert c.job_container_runtime() == expected
    assert c.job_container_runtime() == expected
    assert (tmp_path / "srun-calls").read_text().count("x") == 1  # asked once per cluster
    assert f"({expected})" in c._script_for_job(job())


def test_auto_without_any_runtime_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(_stand_ins(tmp_path, "  --container=PATH", ())))
    with pytest.raises(ConfigurationError, match="no container runtime.*set container_runtime to one of pyxis"):
        cluster(local=True, container_runtime="auto").validate_job(job())


# ---- the podman launch as bash runs it, against a recording stand-in --------------------------------------


def test_podman_launch_passes_env_by_name_and_numbers_the_gpus(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "podman.json"
    (bin_dir / "podman").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    (bin_dir / "podman").chmod(0o755)
    workdir = tmp_path / "job"
    workdir.mkdir()
    secret_file = workdir / ".secret.env"
    secret_file.write_text("API_TOKEN='tok en $x'\n")
    container = Container(
        image=IMAGE,
        runtime="podman",
        auth_file=str(workdir / REGISTRY_AUTH_NAME),
        env_names=("API_TOKEN",),
        workdir="/workload",
    )
    text = sbatch_script(
        ["python", "train.py", "--flag", "a b"],
        workdir=str(workdir),
        env={"HPARAMS": '{"lr": 0.1}'},
        secret_env_file=str(secret_file),
        container=container,
    )
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_GPUS": "2,3",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)

    seen = json.loads(record.read_text())
    argv = seen["argv"]
    assert argv[:4] == ["run", "--rm", "--network=host", "--pull=missing"]
    assert argv[-5:] == [IMAGE, "python", "train.py", "--flag", "a b"]
    assert f"--authfile={workdir / REGISTRY_AUTH_NAME}" in argv
    assert f"--volume={workdir}:{workdir}" in argv and "--workdir=/workload" in argv
    assert {"--env=HPARAMS", "--env=API_TOKEN", "--env=SLURM_*"} <= set(argv)
    # Allocated GPUs 2 and 3 as CDI devices, seen as 0 and 1 inside.
    assert [a for a in argv if a.startswith("--device")] == ["--device=nvidia.com/gpu=2", "--device=nvidia.com/gpu=3"]
    assert "--env=CUDA_VISIBLE_DEVICES=0,1" in argv
    # Values come from podman's environment, never from its command line.
    assert seen["env"]["API_TOKEN"] == "tok en $x" and seen["env"]["HPARAMS"] == '{"lr": 0.1}'
    assert not any("tok en" in a for a in argv) and "tok en" not in text


# ---- integration: the real local Slurm and registry --------------------------------------------------------

PROBE = """\
import json, os, sys
os.makedirs(os.path.dirname(os.environ["CHECKPOINT_DIR"]), exist_ok=True)
out = os.path.join(os.path.dirname(os.environ["CHECKPOINT_DIR"]), "probe.json")
names = ("HPARAMS", "CHECKPOINT_DIR", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "PYTHONUNBUFFERED",
         "CONTAINERS_CONF")
with open(out + ".tmp", "w") as f:
    json.dump({
        "marker": open("/workload/IMAGE_MARKER").read(),
        "containerenv": os.path.exists("/run/.containerenv"),
        "python": sys.executable,
        "cwd": os.getcwd(),
        "env": {n: os.environ.get(n) for n in names},
    }, f)
os.replace(out + ".tmp", out)
print("probe ran in the image", flush=True)
"""


@pytest.fixture(scope="module")
def stacks() -> dict[str, str]:
    env = {**stack_env("slurm"), **stack_env("registry")}
    env["REGISTRY_PASSWORD"] = Path(env["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    return env


@pytest.fixture(scope="module")
def image(
    stacks: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ImageRef, str, object, Path]]:
    """The workload image plus a marker only it has, built on the stack's base, pushed, and NOT kept locally."""
    import docker
    from prefect_docker.host import DockerHost

    from blocks.docker.image import DockerImageBuilder
    from blocks.workload.source import load_workload
    from tests.examples import DIGITS

    context = tmp_path_factory.mktemp("image") / "digits"
    shutil.copytree(DIGITS, context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    marker = f"gpuferry-image-{uuid.uuid4().hex}"
    (context / "IMAGE_MARKER").write_text(marker)
    (context / "probe.py").write_text(PROBE)
    builder = DockerImageBuilder(
        docker_host=DockerHost(base_url=stacks["DOCKER_HOST"]),
        credentials=registry_login(),
        repository=f"gpuferry-test/slurm-{uuid.uuid4().hex[:8]}",
        build_args={"BASE_IMAGE": stacks["BASE_IMAGE"]},
    )
    ref = builder.build(load_workload(str(context)))
    assert ref.reference and "@sha256:" in ref.reference
    engine = docker.DockerClient(base_url=stacks["DOCKER_HOST"], timeout=300)
    engine.images.remove(f"{builder.image_name()}:{ref.content_tag}")  # the job must pull it, with the login
    yield ref, marker, builder, context
    for local in engine.images.list(name=builder.image_name()):
        engine.images.remove(local.id, force=True)
    engine.close()


@pytest.fixture(scope="module")
def slurm(stacks: dict[str, str]) -> Iterator[SlurmCluster]:
    root = cluster_dir("image-tests")  # on the cluster's own filesystem: not a path of this machine's
    c = slurm_for_images(
        root,
        poll_interval_start=0.5,
        poll_interval_max=3.0,
        python=stacks["SLURM_CLUSTER_PYTHON"],
        container_runtime="auto",  # asks the login node: podman here
    )
    yield c
    remove_on_cluster(c, root)
    c.close()


def on_cluster(c: SlurmCluster, path: str) -> str:
    """The text of the file ``path`` on the cluster (read over the block's session)."""
    rc, out, err = c.run(["cat", "--", path], check=False)
    assert rc == 0, f"{path} on the cluster: {err}"
    return out


def exists_on_cluster(c: SlurmCluster, path: str) -> bool:
    return c.run(["test", "-e", path], check=False)[0] == 0


def _job(
    c: SlurmCluster, ref: ImageRef, name: str, command: tuple[str, ...] = ("python", "train.py"), **resources: object
) -> TrainingJob:
    key = f"t{uuid.uuid4().hex[:10]}-{name}"
    return TrainingJob(
        key=key,
        workdir=c.job_workdir(key),
        image=ref,
        command=list(command),
        env={"HPARAMS": json.dumps({"epochs": 2, "hidden": 16}), "CHECKPOINT_EVERY": "5"},
        resources=Resources(time_limit_minutes=20, mem_gb=2, **resources),
    )


@pytest.mark.integration
def test_wrong_registry_password_fails_the_job_with_the_pull_error(
    slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path], stacks: dict[str, str]
) -> None:
    wrong = "wrong-" + uuid.uuid4().hex[:8]
    c = slurm.model_copy(update={"registry_credentials": registry_login(wrong)})
    job_ = _job(c, image[0], "badlogin")
    handle = c.submit(job_)
    status = c.watch(handle, timeout_seconds=600)
    with pytest.raises(JobFailed) as caught:
        c.result(handle, status)
    assert "unauthorized" in caught.value.log_tail.lower() or "authentication required" in caught.value.log_tail
    assert wrong not in caught.value.log_tail
    assert wrong not in on_cluster(c, f"{job_.workdir}/job.sbatch")


@pytest.mark.integration
def test_job_runs_inside_the_pulled_image(
    slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path], stacks: dict[str, str]
) -> None:
    ref, marker, *_ = image
    assert slurm.job_container_runtime() == "podman"  # this srun has no --container-image
    probe = slurm
    job_ = _job(probe, ref, "probe", ("python", "probe.py"), gpus_per_node=2)
    handle = probe.submit(job_)
    status = probe.watch(handle, timeout_seconds=600)
    log, _ = probe.read_log(handle)
    assert status.state == "COMPLETED", log[-3000:]
    seen = json.loads(on_cluster(probe, f"{job_.workdir}/probe.json"))
    assert seen["marker"] == marker  # a file only this image has
    assert seen["containerenv"] and seen["python"] == "/opt/venv/bin/python"  # podman's marker; the image's venv
    assert seen["cwd"] == "/workload"  # the image's code, where the workload's command runs
    assert seen["env"]["HPARAMS"] == job_.env["HPARAMS"]
    assert seen["env"]["CHECKPOINT_DIR"] == f"{job_.workdir}/checkpoints"
    assert seen["env"]["SLURM_JOB_ID"] == handle.job_id
    assert len(seen["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    assert seen["env"]["CONTAINERS_CONF"] is None  # the runtime's settings stay outside
    assert "probe ran in the image" in log
    assert ref.reference.split("@")[1] in log or "Copying blob" in log or "Trying to pull" in log, log[-3000:]
    # The login was a file next to the script (0600: see the cancel test), not in it; the job completed and
    # removed it itself.
    assert stacks["REGISTRY_PASSWORD"] not in on_cluster(probe, f"{job_.workdir}/job.sbatch")
    assert not exists_on_cluster(probe, f"{job_.workdir}/{REGISTRY_AUTH_NAME}")
    probe.result(handle, status)


@pytest.mark.integration
def test_sweep_array_tasks_get_their_own_settings_in_the_container(
    slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path]
) -> None:
    probe = slurm
    job_ = _job(probe, image[0], "sweep", ("python", "probe.py"))
    rates = (0.1, 0.2, 0.3)
    handle = probe.submit_sweep(job_, [{"HPARAMS": json.dumps({"lr": lr})} for lr in rates])
    status = probe.watch(handle, timeout_seconds=600)
    assert status.state == "COMPLETED", probe.log_tail(handle)
    for index, lr in enumerate(rates):
        task_dir = probe.task_dir(job_.workdir, index)
        seen = json.loads(on_cluster(probe, f"{task_dir}/probe.json"))
        assert json.loads(seen["env"]["HPARAMS"]) == {"lr": lr}  # the task's own value, not the job's
        assert seen["env"]["CHECKPOINT_DIR"] == f"{task_dir}/checkpoints"
        assert seen["env"]["SLURM_ARRAY_TASK_ID"] == str(index)
        assert seen["containerenv"]


@pytest.mark.integration
def test_training_in_the_image_writes_its_checkpoint_to_the_jobs_directory(
    slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path]
) -> None:
    job_ = _job(slurm, image[0], "train")
    handle = slurm.submit(job_)
    assert slurm.submit(job_).job_id == handle.job_id  # idempotent as without an image
    progress: list[dict] = []
    status = slurm.watch(handle, on_progress=progress.append, timeout_seconds=900)
    log, _ = slurm.read_log(handle)
    assert status.state == "COMPLETED", log[-3000:]
    result = slurm.result(handle, status)
    assert slurm.inspect_model(f"{result.checkpoint_dir}/final").pyfunc  # read by the cluster's own Python
    assert 0 <= progress[-1]["metrics"]["val_accuracy"] <= 1
    _, listing, _ = slurm.run(["ls", "--", result.checkpoint_dir])
    assert [name for name in listing.split() if name.startswith("step-")]  # periodic checkpoints too
    assert progress and progress[-1]["step"] == progress[-1]["total_steps"]
    assert result.cpu_hours > 0


@pytest.mark.integration
def test_warning_signal_reaches_the_program_in_the_container_which_resumes(
    slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path]
) -> None:
    import re
    import time

    job_ = _job(slurm, image[0], "signal")
    job_ = job_.model_copy(
        update={
            "env": {
                **job_.env,
                "HPARAMS": json.dumps({"epochs": 60, "batch_size": 16}),
                "CHECKPOINT_EVERY": "25",
                "OMP_NUM_THREADS": "1",
            }
        }
    )
    handle = slurm.submit(job_)
    deadline = time.monotonic() + 300
    while (slurm.read_progress(handle) or {}).get("step", 0) < 40:
        assert time.monotonic() < deadline, slurm.read_log(handle)[0][-3000:]
        time.sleep(1)
    # What Slurm does ahead of the time limit (--signal=B:USR1@90): USR1 to the batch shell only.
    slurm.run(["scancel", "--batch", "--signal=USR1", handle.job_id])
    status = slurm.watch(handle, timeout_seconds=900)
    log, _ = slurm.read_log(handle)
    assert status.state == "COMPLETED", log[-3000:]
    saved = [int(m) for m in re.findall(r"preempted: saved checkpoint at step (\d+)/", log)]
    resumed = [int(m) for m in re.findall(r"resumed from step-\d+: step (\d+),", log)]
    assert len(saved) == 1 and resumed == saved, log[-3000:]  # podman proxied USR1; the requeued job resumed
    assert "requeueing job" in log
    assert exists_on_cluster(slurm, f"{job_.workdir}/checkpoints/final/MLmodel")


@pytest.mark.integration
def test_cancelled_job_stops_its_container(slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path]) -> None:
    import time

    job_ = _job(slurm, image[0], "cancel")
    job_ = job_.model_copy(
        update={"env": {**job_.env, "HPARAMS": json.dumps({"epochs": 200, "batch_size": 16}), "OMP_NUM_THREADS": "1"}}
    )
    handle = slurm.submit(job_)
    deadline = time.monotonic() + 300
    while (slurm.read_progress(handle) or {}).get("step", 0) < 10:
        assert time.monotonic() < deadline, slurm.read_log(handle)[0][-3000:]
        time.sleep(1)
    # The nodes' podman, as the jobs run it (its settings are the block's container_runtime_env).
    podman = ["env", *(f"{k}={v}" for k, v in slurm.container_runtime_env.items()), "podman"]

    def containers_in(workdir: str) -> list[str]:
        _, out, _ = slurm.run([*podman, "ps", "--format", "{{.ID}} {{.Mounts}}"])
        return [line for line in out.splitlines() if workdir in line]

    assert len(containers_in(job_.workdir)) == 1
    auth = f"{job_.workdir}/{REGISTRY_AUTH_NAME}"  # the registry login: a 0600 file while the job may run
    assert slurm.run(["stat", "-c", "%a", "--", auth])[1].strip() == "600"
    slurm.cancel(handle)
    assert not exists_on_cluster(slurm, auth)  # cancelled: it never starts again
    status = slurm.watch(handle, timeout_seconds=300)
    assert status.state == "CANCELLED", status
    # Slurm's TERM reached the program through podman: it saved a checkpoint, and its container is gone.
    deadline = time.monotonic() + 120
    while containers_in(job_.workdir):
        assert time.monotonic() < deadline, containers_in(job_.workdir)
        time.sleep(1)
    log, _ = slurm.read_log(handle)
    assert "preempted: saved checkpoint at step" in log, log[-3000:]


@pytest.mark.integration
def test_two_node_torchrun_in_containers(slurm: SlurmCluster, image: tuple[ImageRef, str, object, Path]) -> None:
    # Both "nodes" of the local cluster are this one host: torchrun tells its agents apart by hostname and
    # PID, and each container's launcher would be PID 1 on host "vm" (one participant, twice). Real nodes
    # differ by hostname; here the containers share the host's PID namespace instead.
    c = slurm.model_copy(update={"podman_options": ["--pid=host"]})
    job_ = _job(c, image[0], "ddp", nodes=2, processes_per_node=1)
    handle = c.submit(job_)
    status = c.watch(handle, timeout_seconds=900)
    log, _ = c.read_log(handle)
    assert status.state == "COMPLETED", log[-3000:]
    assert "world size 2" in log, log[-3000:]
    assert exists_on_cluster(c, f"{job_.workdir}/checkpoints/final/MLmodel")


@pytest.mark.integration
@pytest.mark.usefixtures("prefect_server")
def test_retrain_builds_the_image_and_trains_inside_it(
    slurm: SlurmCluster,
    image: tuple[ImageRef, str, object, Path],
    stacks: dict[str, str],
    s3_store: S3CheckpointStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole pipeline with a Stack: DockerImageBuilder → SlurmCluster (podman) → S3 → MLflow server."""
    from blocks.base.provider import ClusterManaged
    from blocks.local.serving import LocalServing
    from blocks.specs import TrainingSpec
    from blocks.stack import Stack
    from flows.retrain import retrain

    tracking, s3_env = mlflow_server(), stack_env("s3")
    ref, _, builder, context = image
    bucket = s3_store.bucket.bucket_name  # a bucket of the test's own on the s3 stack, removed afterwards
    # The local inference server reads the s3:// checkpoint with boto3's own variables.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, s3_env[name])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["S3_ENDPOINT_URL"])
    stack = Stack(
        provider=ClusterManaged(cluster_name="gpuferry-test"),
        images=builder,
        compute=slurm,
        storage=s3_store,
        tracking=tracking,
        serving=LocalServing(),
    )
    name = f"slurm-image-{uuid.uuid4().hex[:8]}"
    stack.save(name, overwrite=True)
    tag = uuid.uuid4().hex[:8]
    outcome = retrain(
        workload=str(context),
        training=TrainingSpec(
            experiment=f"gpuferry-image-{tag}",
            model_name=f"digits-image-{tag}",
            hyperparameters={"epochs": 3},
            resources=Resources(mem_gb=2),
        ),
        stack=name,
    )
    try:
        assert outcome.image.reference == ref.reference and not outcome.image.built  # the same content: a tag hit
        run = tracking.client.get_run(outcome.run_id)
        assert run.data.tags["image"] == ref.reference
        assert run.data.metrics["val_accuracy"] == pytest.approx(
            outcome.model_version.value
        )  # logged from the container
        assert run.data.metrics["cpu_hours"] > 0
        key = f"{run.data.tags['prefect.flow_run_id']}-train"
        script = on_cluster(slurm, f"{slurm.job_workdir(key)}/job.sbatch")
        assert "exec podman run" in script and ref.reference in script
        assert outcome.checkpoint.uri.startswith(f"s3://{bucket}/")
        assert outcome.deployed and outcome.endpoint is not None
    finally:
        LocalServing().undeploy("digits")
