"""The containers of the Docker backends as the engines' APIs take them (blocks/docker/spec.py), golden bodies,
and the pure parts of blocks/docker/engine.py (log offsets). No engine needed."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC
from pathlib import Path

import pytest

from blocks.base.secrets import ENV_FILE_LAUNCHER, secret_env_text, with_env_file
from blocks.docker.engine import LOG_OFFSET_SPAN, read_from, strip_timestamps
from blocks.docker.spec import (
    HealthCheck,
    container_exit_reason,
    container_name,
    docker_body,
    front_container,
    gpu_device_ids,
    http_probe,
    libpod_body,
    server_container,
    training_container,
)
from blocks.errors import ConfigurationError
from tests.test_k8s_manifests import check_golden

IMAGE = "registry.example:5000/team/digits@sha256:" + "ab" * 32


def job_container(gpu_mode: str, **kw: object):
    gpus = gpu_device_ids(
        [(0, "GPU-aaaa"), (2, "GPU-cccc")], by_uuid=gpu_mode == "cdi", gpu_mode=gpu_mode, cdi_kind="nvidia.com/gpu"
    )
    fields = {
        "name": "gpuferry-job-run7-train",
        "image": IMAGE,
        "command": ["python", "train.py"],
        "env": {"HPARAMS": '{"epochs": 2}', "CHECKPOINT_DIR": "/shared/jobs/run7-train/checkpoints"},
        "labels": {
            "io.gpuferry.kind": "job",
            "io.gpuferry.job-key": "run7-train",
            "io.gpuferry.gpus": "GPU-aaaa,GPU-cccc",
        },
        "workdir": "/shared/jobs/run7-train",
        "image_workdir": "/workload",
        "gpus": gpus,
        "gpu_count": 2,
        "gpu_mode": gpu_mode,
        "mounts": ["/datasets"],
        "shm_size_mb": 2048,
        "memory_mb": 4096,
        "stop_timeout_s": 60,
        "secret_file": "/shared/jobs/run7-train/.secret.env",
    }
    fields.update(kw)
    return training_container(**fields)  # type: ignore[arg-type]


def serve_container():
    return server_container(
        name="gpuferry-serve-digits-v3-abc123",
        image=IMAGE,
        command=None,
        port=8080,
        env={"MODEL_URI": "file:///store/digits/run1"},
        labels={"io.gpuferry.kind": "server"},
        workdir=None,
        gpus=("nvidia.com/gpu=1",),
        gpu_count=1,
        gpu_mode="cdi",
        model_dir="/store/digits/run1",
        network="gpuferry-serving",
        aliases=("v3-abc123-digits",),
        bind_address="127.0.0.1",
        restart_policy="unless-stopped",
        healthcheck=HealthCheck(
            http_probe(8080, "/healthz"), interval_s=10, timeout_s=3, retries=3, start_period_s=120
        ),
        stop_timeout_s=30,
    )


def test_golden_training_job_docker_nvidia() -> None:
    body = docker_body(job_container("nvidia"))
    check_golden("docker_job_nvidia", body)
    assert body["HostConfig"]["DeviceRequests"] == [
        {"Driver": "nvidia", "DeviceIDs": ["0", "2"], "Capabilities": [["gpu"]]}
    ]  # what --gpus '"device=0,2"' sends


def test_golden_training_job_docker_cdi_and_podman() -> None:
    spec = job_container("cdi")
    docker, podman = docker_body(spec), libpod_body(spec)
    check_golden("docker_job_cdi", docker)
    check_golden("podman_job_cdi", podman)
    names = ["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=GPU-cccc"]
    assert docker["HostConfig"]["DeviceRequests"] == [{"Driver": "cdi", "DeviceIDs": names}]
    assert podman["devices"] == [{"path": n} for n in names]
    assert podman["netns"] == {"nsmode": "host"}
    # The argv is the shell's arguments, never its script: the file's path is $1, the job's argv the rest.
    assert podman["command"] == [
        "sh",
        "-c",
        ENV_FILE_LAUNCHER,
        "gpuferry-env",
        "/shared/jobs/run7-train/.secret.env",
        "python",
        "train.py",
    ]


def test_golden_server_docker_and_podman() -> None:
    spec = serve_container()
    check_golden("docker_server", docker_body(spec))
    check_golden("podman_server", libpod_body(spec))
    assert docker_body(spec)["HostConfig"]["PortBindings"] == {"8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}
    assert {
        "type": "bind",
        "source": "/store/digits/run1",
        "destination": "/store/digits/run1",
        "options": ["rbind", "ro"],
    } in libpod_body(spec)["mounts"]
    # The front reaches the version by its alias on the service's network.
    assert docker_body(spec)["NetworkingConfig"] == {
        "EndpointsConfig": {"gpuferry-serving": {"Aliases": ["v3-abc123-digits"]}}
    }
    assert libpod_body(spec)["networks"] == {"gpuferry-serving": {"aliases": ["v3-abc123-digits"]}}


def test_golden_front_docker_and_podman() -> None:
    spec = front_container(
        name="gpuferry-front-digits",
        image=IMAGE,
        target="v3-abc123-digits:8080",
        labels={"io.gpuferry.kind": "front", "io.gpuferry.service": "digits"},
        network="gpuferry-serving",
        bind_address="0.0.0.0",
        host_port=8500,
    )
    docker, podman = docker_body(spec), libpod_body(spec)
    check_golden("docker_front", docker)
    check_golden("podman_front", podman)
    assert docker["HostConfig"]["PortBindings"] == {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "8500"}]}
    assert podman["portmappings"] == [
        {"container_port": 8000, "host_ip": "0.0.0.0", "protocol": "tcp", "host_port": 8500}
    ]
    assert docker["Cmd"] == ["python", "-m", "runtime.front"] and "FRONT_TARGET=v3-abc123-digits:8080" in docker["Env"]
    assert "DeviceRequests" not in docker["HostConfig"] and "devices" not in podman
    unpinned = front_container(
        name="f", image=IMAGE, target="v1-x-s:8080", labels={}, network="n", bind_address="127.0.0.1", host_port=None
    )
    assert docker_body(unpinned)["HostConfig"]["PortBindings"]["8000/tcp"][0]["HostPort"] == ""  # the engine picks
    assert "host_port" not in libpod_body(unpinned)["portmappings"][0]


def test_a_job_without_gpus_sees_none() -> None:
    spec = job_container("nvidia", gpus=(), gpu_count=0, secret_file=None)
    body = docker_body(spec)
    assert "DeviceRequests" not in body["HostConfig"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in body["Env"] and "CUDA_VISIBLE_DEVICES=" in body["Env"]
    assert body["Cmd"] == ["python", "train.py"]


def test_podman_takes_gpus_only_as_cdi_names() -> None:
    with pytest.raises(ConfigurationError, match="podman takes GPUs as CDI devices only: set gpu_mode='cdi'"):
        libpod_body(job_container("nvidia"))


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigurationError, match="mounts: 'data' must be an absolute path"):
        job_container("nvidia", mounts=["data"])
    with pytest.raises(ConfigurationError, match="env: 'BAD NAME' is not a variable name"):
        job_container("nvidia", env={"BAD NAME": "x"})
    with pytest.raises(ConfigurationError, match="cdi_kind='nvidia' is not a CDI kind"):
        gpu_device_ids([(0, None)], by_uuid=False, gpu_mode="cdi", cdi_kind="nvidia")
    with pytest.raises(ConfigurationError, match="asked for by UUID but the host's inventory has no UUID"):
        gpu_device_ids([(0, None)], by_uuid=True, gpu_mode="nvidia", cdi_kind="nvidia.com/gpu")
    with pytest.raises(ConfigurationError, match="restart_policy='sometimes'"):
        server_container(
            name="s",
            image=IMAGE,
            command=None,
            port=8080,
            env={},
            labels={},
            workdir=None,
            gpus=(),
            gpu_count=0,
            gpu_mode="cdi",
            restart_policy="sometimes",
        )
    assert container_name("gpuferry-serve", "my service/x", "v1") == "gpuferry-serve-my-service-x-v1"


def test_the_secret_file_reaches_the_program_by_value_never_by_parsing(tmp_path: Path) -> None:
    """The launcher as a real shell runs it: values with quotes, $ and spaces arrive as they are."""
    values = {"API_TOKEN": "tok en $HOME `id` 'q' \"d\"", "EMPTY": ""}
    path = tmp_path / "secret.env"
    path.write_text(secret_env_text(values))
    probe = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('API_TOKEN', 'EMPTY')}))"
    argv = with_env_file(["python3", "-c", probe], str(path))
    out = subprocess.run(
        list(argv), capture_output=True, text=True, check=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert json.loads(out.stdout) == values
    assert values["API_TOKEN"] not in " ".join(argv)
    with pytest.raises(ConfigurationError, match="not a variable name"):
        secret_env_text({"A-B": "x"})


def test_exit_codes_become_actionable_messages() -> None:
    state, reason = container_exit_reason(137, oom_killed=True, memory_mb=2048)
    assert state == "OUT_OF_MEMORY" and "its memory limit (2048 MiB)" in reason and "resources.mem_gb" in reason
    state, reason = container_exit_reason(137, oom_killed=False, memory_mb=None)
    assert state == "FAILED" and "SIGKILL" in reason and "stop_timeout_seconds" in reason
    state, reason = container_exit_reason(137, oom_killed=False, memory_mb=256)
    assert state == "OUT_OF_MEMORY" and "exceeding its memory limit (256 MiB" in reason and "resources.mem_gb" in reason
    assert "not in the image" in container_exit_reason(127, oom_killed=False, memory_mb=None, program="pythn")[1]
    assert container_exit_reason(2, oom_killed=False, memory_mb=None)[1].startswith("the job rejected its arguments")


# ---- log offsets ----------------------------------------------------------------------------------------


def _stamp(second: int) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_log_offsets_skip_what_was_read_within_a_second() -> None:
    """podman stamps lines to the second: a second is read again and its lines already seen are skipped."""
    t = 1_800_000_000
    first = f"{_stamp(t)} a\n{_stamp(t)} b\n".encode()
    text, offset = read_from(first, 0, final=False)
    assert text == "a\nb\n" and offset == t * LOG_OFFSET_SPAN + 2
    # The engine sends that second again (since=t), with a line more, then the next second; and a half line.
    again = f"{_stamp(t)} a\n{_stamp(t)} b\n{_stamp(t)} c\n{_stamp(t + 1)} d\n{_stamp(t + 1)} parti".encode()
    text, offset = read_from(again, offset, final=False)
    assert text == "c\nd\n" and offset == (t + 1) * LOG_OFFSET_SPAN + 1
    text, offset = read_from(again + b"al\n", offset, final=True)
    assert text == "partial\n"
    assert read_from(again + b"al\n", offset, final=True) == ("", offset)


def test_nanosecond_stamps_and_stripping() -> None:
    raw = b"2026-01-02T03:04:05.123456789Z step 1\n2026-01-02T03:04:05.5Z step 2\n"
    assert read_from(raw, 0, final=True)[0] == "step 1\nstep 2\n"
    assert strip_timestamps(raw) == "step 1\nstep 2\n"


def test_a_server_learns_its_device_from_its_gpus_and_the_blocks_env_may_say_otherwise() -> None:
    def env_of(gpus: int, env: dict[str, str]) -> dict[str, str]:
        spec = server_container(
            name="s",
            image=IMAGE,
            command=None,
            port=8080,
            env=env,
            labels={},
            workdir=None,
            gpus=("0",) * gpus,
            gpu_count=gpus,
            gpu_mode="cdi",
        )
        return dict(spec.env)

    assert env_of(1, {})["MODEL_DEVICE"] == "cuda"
    cpu = env_of(0, {})
    assert (cpu["MODEL_DEVICE"], cpu["CUDA_VISIBLE_DEVICES"], cpu["NVIDIA_VISIBLE_DEVICES"]) == ("cpu", "", "void")
    assert env_of(1, {"MODEL_DEVICE": "cpu"})["MODEL_DEVICE"] == "cpu"  # stand-in GPUs without CUDA, say
