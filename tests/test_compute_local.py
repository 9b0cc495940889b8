"""The local-process compute backend: idempotent submit, requeue on preemption, actionable failures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.base.launch import launch_command
from blocks.errors import ConfigurationError, JobFailed
from blocks.local.compute import LocalProcesses
from blocks.records import CodeRef, TrainingJob
from blocks.specs import Resources

# A stand-in job: each start appends to starts.txt, then behaves as BEHAVIOUR (a list, one per start) says.
FAKE_JOB = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    ckpt = Path(os.environ["CHECKPOINT_DIR"]); ckpt.mkdir(parents=True, exist_ok=True)
    starts = ckpt / "starts.txt"
    n = len(starts.read_text().splitlines()) if starts.exists() else 0
    with open(starts, "a") as f: f.write("start\\n")
    behaviour = json.loads(os.environ["BEHAVIOUR"])[min(n, len(json.loads(os.environ["BEHAVIOUR"])) - 1)]
    print(f"attempt {n} does {behaviour}", flush=True)
    Path(os.environ["PROGRESS_FILE"]).write_text(json.dumps({"step": n, "total_steps": 2}))
    if behaviour == "wait":
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        while not stop and not (ckpt / "go").exists(): time.sleep(0.02)
        sys.exit(75 if stop else 0)
    if behaviour == "oom": os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "launcher-preempted":  # what torchrun reports when a worker stopped for preemption
        (ckpt / "PREEMPTED").write_text("1"); sys.exit(1)
    if behaviour == "env":  # what the job's environment holds
        (ckpt / "env.json").write_text(json.dumps(dict(os.environ), sort_keys=True)); sys.exit(0)
    if behaviour == "env-wait":  # the same, then it waits for "go"
        (ckpt / "env.json").write_text(json.dumps(dict(os.environ), sort_keys=True))
        while not (ckpt / "go").exists(): time.sleep(0.02)
        sys.exit(0)
    (ckpt / "PREEMPTED").unlink(missing_ok=True)
    sys.exit(int(behaviour))
    """
)


@pytest.fixture
def backend(tmp_path: Path) -> LocalProcesses:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job.py").write_text(FAKE_JOB)
    return LocalProcesses(workdir_root=str(tmp_path / "jobs"), poll_interval_max=0.2)


def job(
    backend: LocalProcesses, key: str, *behaviour: str, secrets: dict[str, str] | None = None, **resources: int
) -> TrainingJob:
    code = Path(backend.workdir_root).parent / "code"
    return TrainingJob(
        key=key,
        workdir=backend.job_workdir(key),
        command=["python", "job.py"],
        env={"BEHAVIOUR": json.dumps(list(behaviour))},
        secrets=secrets or {},
        resources=Resources(**resources),
        code=CodeRef(root=str(code), archive=str(code / "unused.tar.gz"), sha256="0" * 64),
    )


def wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def starts(backend: LocalProcesses, key: str) -> int:
    path = Path(backend.job_workdir(key)) / "checkpoints" / "starts.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_completes_and_streams_output(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "ok", "0"))
    output: list[str] = []
    progress: list[dict] = []
    status = backend.watch(handle, on_output=output.append, on_progress=progress.append, timeout_seconds=120)
    assert status.state == "COMPLETED" and status.exit_code == 0
    assert "attempt 0 does 0" in "".join(output)
    assert progress and progress[-1]["total_steps"] == 2
    result = backend.result(handle, status)
    assert result.checkpoint_dir == str(Path(handle.workdir) / "checkpoints")


def test_resubmit_adopts_the_running_job(backend: LocalProcesses) -> None:
    first = backend.submit(job(backend, "once", "wait"))
    wait_for(lambda: starts(backend, "once") == 1)
    second = backend.submit(job(backend, "once", "wait"))
    assert second == first
    (Path(first.workdir) / "checkpoints" / "go").touch()
    assert backend.watch(first, timeout_seconds=120).state == "COMPLETED"
    assert backend.submit(job(backend, "once", "wait")) == first  # a finished job is adopted too
    assert starts(backend, "once") == 1


def test_preempted_job_is_requeued_and_resumes(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "pre", "75", "0", max_requeues=2))
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "COMPLETED"
    assert backend.result(handle, status).requeues == 1
    assert starts(backend, "pre") == 2


def test_preemption_marker_counts_when_a_launcher_hides_the_exit_code(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "torchrun", "launcher-preempted", "0", max_requeues=2))
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "COMPLETED"
    assert backend.result(handle, status).requeues == 1


def test_requeues_are_bounded(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "loop", "75", max_requeues=1))
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "FAILED" and status.exit_code == 75
    assert starts(backend, "loop") == 2
    with pytest.raises(JobFailed, match="preempted"):
        backend.result(handle, status)


def test_killed_job_says_memory(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "oom", "oom"))
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "OUT_OF_MEMORY"
    with pytest.raises(JobFailed, match="give it more memory") as info:
        backend.result(handle, status)
    assert "attempt 0 does oom" in info.value.log_tail


def test_failure_carries_exit_code_and_log(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "bad", "3"))
    status = backend.watch(handle, timeout_seconds=120)
    with pytest.raises(JobFailed, match="exit code 3") as info:
        backend.result(handle, status)
    assert info.value.exit_code == 3 and "attempt 0 does 3" in info.value.log_tail


def test_cancel_is_not_requeued(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "cancel", "wait", max_requeues=3))
    wait_for(lambda: starts(backend, "cancel") == 1)
    backend.cancel(handle)
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "CANCELLED"
    assert starts(backend, "cancel") == 1


def test_supervisor_death_is_a_failure(backend: LocalProcesses) -> None:
    handle = backend.submit(job(backend, "lost", "wait"))
    wait_for(lambda: starts(backend, "lost") == 1)
    state = json.loads((Path(handle.workdir) / "job.json").read_text())
    os.killpg(state["pid"], signal.SIGKILL)  # the supervisor and its job, as a node failure would
    status = backend.watch(handle, timeout_seconds=120)
    assert status.state == "FAILED" and "supervisor" in status.reason


def test_rejects_what_it_cannot_run(backend: LocalProcesses) -> None:
    with pytest.raises(ConfigurationError, match="resources.nodes=2"):
        backend.submit(job(backend, "multi", "0", nodes=2))
    assert not Path(backend.job_workdir("multi")).exists()
    with pytest.raises(ConfigurationError, match="no workload directory on this machine"):
        backend.validate_job(job(backend, "x", "0").model_copy(update={"code": None}))


def test_the_job_gets_the_contract_and_its_own_variables_not_this_processs(
    backend: LocalProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted-aws-secret")
    monkeypatch.setenv("PREFECT_API_KEY", "planted-prefect-key")
    handle = backend.submit(job(backend, "env", "env"))
    assert backend.watch(handle, timeout_seconds=120).state == "COMPLETED"
    env = json.loads((Path(handle.workdir) / "checkpoints" / "env.json").read_text())
    assert env["CHECKPOINT_DIR"] == str(Path(handle.workdir) / "checkpoints") and "BEHAVIOUR" in env
    assert "AWS_SECRET_ACCESS_KEY" not in env and "PREFECT_API_KEY" not in env and "PYTHONPATH" not in env
    assert env["PATH"] == os.environ["PATH"]


@pytest.mark.usefixtures("prefect_server")
def test_secrets_come_from_prefect_secret_blocks(backend: LocalProcesses) -> None:
    from prefect.blocks.system import Secret

    Secret(value="s3cr3t-value").save("local-job-token", overwrite=True)
    handle = backend.submit(job(backend, "secret", "env", secrets={"HF_TOKEN": "local-job-token"}))
    assert backend.watch(handle, timeout_seconds=120).state == "COMPLETED"
    env = json.loads((Path(handle.workdir) / "checkpoints" / "env.json").read_text())
    assert env["HF_TOKEN"] == "s3cr3t-value"
    assert "s3cr3t-value" not in (Path(handle.workdir) / "job.json").read_text()
    with pytest.raises(
        ConfigurationError, match="names the Prefect Secret block 'no-such-secret', which does not exist"
    ):
        backend.submit(job(backend, "nosecret", "env", secrets={"HF_TOKEN": "no-such-secret"}))


def test_the_pipelines_secrets_reach_every_attempt_through_a_0600_file_only(backend: LocalProcesses) -> None:
    planted = f"planted-{uuid.uuid4().hex}"
    secret = {"MLFLOW_TRACKING_PASSWORD": SecretStr(planted)}
    handle = backend.submit(
        job(backend, "login", "75", "env-wait", max_requeues=1).model_copy(update={"secret_env": secret})
    )
    workdir = Path(handle.workdir)
    env_json = workdir / "checkpoints" / "env.json"
    # Polls requeue a preempted local job.
    wait_for(lambda: backend.poll([handle]) and env_json.exists() and starts(backend, "login") == 2, timeout=120)
    # The requeued attempt has it too, though the job's record (which the requeue starts from) holds none.
    assert json.loads(env_json.read_text())["MLFLOW_TRACKING_PASSWORD"] == planted
    assert planted not in (workdir / "job.json").read_text()
    secret_file = workdir / ".secret.env"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600 and planted in secret_file.read_text()
    state = json.loads((workdir / "job.json").read_text())
    supervisor = Path(f"/proc/{state['pid']}")
    assert str(secret_file).encode() in (supervisor / "cmdline").read_bytes()  # the job's shell sources the file
    assert planted.encode() not in (supervisor / "environ").read_bytes()  # the supervisor never holds the value
    cmdlines = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdlines.append((entry / "cmdline").read_bytes())
    assert not [c for c in cmdlines if planted.encode() in c]
    (workdir / "checkpoints" / "go").touch()
    assert backend.watch(handle, timeout_seconds=120).state == "COMPLETED"
    assert not secret_file.exists()  # removed when the job ended
    left = [p for p in workdir.rglob("*") if p.is_file() and p != env_json and planted.encode() in p.read_bytes()]
    assert not left


def test_a_workload_secret_cannot_shadow_the_pipelines(backend: LocalProcesses) -> None:
    shadowing = job(backend, "shadow", "0", secrets={"MLFLOW_TRACKING_PASSWORD": "some-block"}).model_copy(
        update={"secret_env": {"MLFLOW_TRACKING_PASSWORD": SecretStr("x")}}
    )
    with pytest.raises(
        ConfigurationError,
        match=r"train.secrets\['MLFLOW_TRACKING_PASSWORD'\] sets a variable the "
        r"pipeline sets itself",
    ):
        backend.submit(shadowing)
    assert not (Path(shadowing.workdir) / "job.json").exists()


@pytest.mark.parametrize(
    ("command", "processes", "expected"),
    [
        (["python", "train.py", "--x"], 1, ["/py", "train.py", "--x"]),
        (
            ["python", "train.py"],
            2,
            ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"],
        ),
        (
            ["/venv/bin/python3.11", "t.py"],
            2,
            ["/venv/bin/python3.11", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "t.py"],
        ),
        (
            ["bash", "run.sh"],
            4,
            [
                "/py",
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=4",
                "--no-python",
                "bash",
                "run.sh",
            ],
        ),
    ],
)
def test_launch_command(command: list[str], processes: int, expected: list[str]) -> None:
    assert launch_command(command, "/py", processes) == expected
