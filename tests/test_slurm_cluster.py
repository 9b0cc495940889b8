"""SlurmCluster against the real local Slurm (`make slurm-up`) as a remote cluster: over SSH with a checked host
key, the job directories on the cluster's own filesystem and the jobs run by the cluster's own Python. This
machine has no such paths: what a job wrote, what the block shipped and what a test plants for a job are read
and written on the cluster, through the block's SSH session (`remote_text`, `remote_exists`, `remote_copy`,
the block's `write_private`). The two local-mode tests run as the flow would on the login node (no SSH), in a
directory of their own that this machine and the cluster's nodes both see, as the login node shares the
cluster's.
"""

from __future__ import annotations

import base64
import io
import json
import os
import posixpath
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks.base.mlflow_model import check_mlflow_model
from blocks.errors import ConfigurationError, JobFailed
from blocks.records import JobStatus, TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources
from runtime import contract
from tests.examples import DIGITS, JOBS, code_of
from tests.stacks import remote_slurm, remove_on_cluster, stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent

# Writes its progress the way the contract says (atomically), prints, and exits with ARGV[1].
TINY = (
    "import json, os, sys, time; p = os.environ['PROGRESS']; "
    "json.dump({'step': 1, 'total_steps': 1}, open(p + '.tmp', 'w')); os.replace(p + '.tmp', p); "
    "print('tiny job on', os.environ.get('SLURMD_NODENAME'), "
    "'gpus', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); "
    "time.sleep(1.5); sys.exit(int(sys.argv[1]))"
)


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return stack_env("slurm")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    c = remote_slurm("cluster-tests", poll_interval_start=0.3, poll_interval_max=2.0)
    yield c
    remove_on_cluster(c, c.workdir_root)
    c.close()


@pytest.fixture
def login_node_dir(env: dict[str, str]) -> Iterator[str]:
    """A job directory root for a flow that runs on the login node, which shares the cluster's filesystem: a
    directory of this machine that the cluster's nodes see too (SLURM_SHARED_DIR)."""
    root = Path(env["SLURM_SHARED_DIR"]) / f"login-node-{uuid.uuid4().hex[:8]}"
    yield str(root)
    if os.environ.get("GPUFERRY_KEEP_JOBS") != "1":
        shutil.rmtree(root, ignore_errors=True)


def remote_text(cluster: SlurmCluster, path: str) -> str:
    """The text of the file ``path`` on the cluster (read over the block's SSH session; missing: an error)."""
    return cluster.run(["cat", "--", path])[1]


def remote_exists(cluster: SlurmCluster, path: str) -> bool:
    """Whether ``path`` exists on the cluster."""
    rc, _, err = cluster.run(["test", "-e", path], check=False)
    assert rc in (0, 1), err
    return rc == 0


def remote_copy(cluster: SlurmCluster, directory: str, into: Path) -> Path:
    """A copy of ``directory`` of the cluster at ``into`` on this machine (a tar over the block's SSH session)."""
    script = 't=$(mktemp) || exit; tar -c -f "$t" -C "$1" . && base64 -- "$t"; rc=$?; rm -f -- "$t"; exit $rc'
    archive = base64.b64decode(cluster.run(["sh", "-c", script, "sh", directory])[1])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def key(name: str) -> str:
    return f"t{uuid.uuid4().hex[:10]}-{name}"


def slurm(env: dict[str, str], *argv: str) -> str:
    """A Slurm command run directly (not through the block), to check what the block did."""
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "SLURM_CONF": env["SLURM_CONF"]},
    ).stdout


def jobs_named(env: dict[str, str], name: str) -> list[str]:
    """Job ids with this name in the controller's memory and in accounting (deduplicated)."""
    live = {
        str(j.get("array_job_id") or j["job_id"])
        for j in json.loads(slurm(env, "squeue", "--json"))["jobs"]
        if j["name"] == name
    }
    acct = {
        line.split("_")[0]
        for line in slurm(
            env, "sacct", "-X", "-n", "-P", f"--name={name}", "--starttime=now-1days", "--format=JobID"
        ).split()
    }
    return sorted(live | acct)


def wait_for(predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(0.3)


def tiny(cluster: SlurmCluster, k: str, code: int = 0, **options: object):  # type: ignore[no-untyped-def]
    """TINY as a job, run by the block's ``python``: the cluster's interpreter."""
    workdir = cluster.job_workdir(k)
    return cluster.submit_command(
        k, [cluster.python, "-c", TINY, str(code)], env={"PROGRESS": f"{workdir}/progress.json"}, **options
    )


def test_one_node_job_over_ssh(cluster: SlurmCluster) -> None:
    handle = tiny(cluster, key("one"))
    output: list[str] = []
    progress: list[dict] = []
    status = cluster.watch(handle, on_output=output.append, on_progress=progress.append, timeout_seconds=120)
    assert status.state == "COMPLETED" and status.exit_code == 0
    assert "tiny job on n" in "".join(output)
    assert progress == [{"step": 1, "total_steps": 1}]
    result = cluster.result(handle, status)
    assert result.cpu_hours > 0 and result.gpu_hours == 0 and result.wall_seconds >= 1
    # The login key's SSH environment sets SLURM_CONF too: plain commands work without the field.
    assert cluster.partition in cluster.model_copy(update={"slurm_conf": None}).partitions()


def test_gpus_per_node_gives_two_devices(cluster: SlurmCluster) -> None:
    handle = tiny(cluster, key("gpu"), gpus_per_node=2)
    status = cluster.watch(handle, timeout_seconds=120)
    assert status.state == "COMPLETED"
    text, _ = cluster.read_log(handle)
    devices = text.split("gpus ")[1].split()[0].split(",")
    assert len(devices) == 2, text
    result = cluster.result(handle, status)
    assert result.gpu_hours == pytest.approx(2 * result.wall_seconds / 3600) and result.gpu_hours > 0


def test_array_of_100_tasks(cluster: SlurmCluster, env: dict[str, str]) -> None:
    k = key("array")
    # sh, not bash: the job inherits the SSH session's SSH_CLIENT, so a bash would run the login user's
    # ~/.bashrc (here pyenv's init, whose output 100 concurrent tasks would race into the logs).
    handle = cluster.submit_command(k, ["sh", "-c", 'echo "task $SLURM_ARRAY_TASK_ID"'], array="0-99")
    status = cluster.watch(handle, timeout_seconds=150)
    assert status.state == "COMPLETED", status
    logs = [
        cluster.read_log(handle.model_copy(update={"log_path": handle.log_path.replace("%a", str(i))}))[0]
        for i in (0, 57, 99)
    ]
    assert logs == ["task 0\n", "task 57\n", "task 99\n"]

    def all_in_sacct() -> bool:
        out = slurm(env, "sacct", "-X", "-n", "-P", "-j", handle.job_id, "--format=JobID,State")
        return sum(line.endswith("|COMPLETED") for line in out.split()) == 100

    wait_for(all_in_sacct, 60, "100 COMPLETED tasks in sacct")  # sacct lags the controller


def test_submit_twice_makes_one_job(cluster: SlurmCluster, env: dict[str, str]) -> None:
    k = key("twice")
    job = TrainingJob(
        key=k,
        workdir=cluster.job_workdir(k),
        command=["sleep", "-c"],
        code=code_of(JOBS),
        resources=Resources(time_limit_minutes=5),
    )  # `sleep -c` fails fast: fine
    sleeper = cluster
    first = sleeper.submit(job)
    second = sleeper.submit(job)  # a retried submit task, the first job still known to the controller
    assert second == first
    # ... and once the controller has forgotten the job: found in the accounting database instead.
    forgetful = sleeper.model_copy()
    ask = forgetful._jobs_named
    object.__setattr__(forgetful, "_jobs_named", lambda name: ([], ask(name)[1]))
    wait_for(lambda: jobs_named(env, k) and forgetful.find_job(k), 60, "the job in sacct")
    assert forgetful.submit(job) == first
    assert jobs_named(env, k) == [first.job_id]


def test_bad_input_is_refused_before_anything_is_submitted(cluster: SlurmCluster, env: dict[str, str]) -> None:
    k = key("nopart")
    with pytest.raises(ConfigurationError, match=f"partition 'nosuch' does not exist.*{cluster.partition}"):
        cluster.submit(
            TrainingJob(
                key=k,
                workdir=cluster.job_workdir(k),
                command=["true"],
                code=code_of(JOBS),
                resources=Resources(partition="nosuch"),
            )
        )
    with pytest.raises(ConfigurationError, match="partition 'nosuch' does not exist"):
        tiny(cluster, k, partition="nosuch")
    with pytest.raises(ConfigurationError, match="job key"):
        tiny(cluster, "x;touch /tmp/pwned")
    with pytest.raises(ConfigurationError, match="job key"):
        cluster.submit(TrainingJob(key="$(id)", workdir=cluster.job_workdir("x"), command=["true"], code=code_of(JOBS)))
    with pytest.raises(ValidationError, match="partition"):
        Resources(partition="gpu;id")
    with pytest.raises(ValidationError, match="gpus_per_node"):
        Resources(gpus_per_node=-1)
    assert jobs_named(env, k) == []
    assert not remote_exists(cluster, cluster.job_workdir(k))


def test_unknown_or_changed_host_key_is_refused(cluster: SlurmCluster, tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()[:2]

    def trusting(known_hosts: str) -> SlurmCluster:
        assert cluster.credentials is not None
        return cluster.model_copy(
            update={"credentials": cluster.credentials.model_copy(update={"known_hosts": known_hosts})}
        )

    changed = trusting(f"[{cluster.host}]:{cluster.port} {' '.join(other)}\n")
    with pytest.raises(ConfigurationError, match="host key .* CHANGED.*confirm the new fingerprint"):
        changed.partitions()
    unknown = trusting("")
    with pytest.raises(ConfigurationError, match="not in known_hosts.*ssh-keyscan"):
        unknown.partitions()


def test_connection_dropped_mid_poll_reconnects(cluster: SlurmCluster, env: dict[str, str]) -> None:
    k = key("drop")
    handle = cluster.submit_command(k, ["sleep", "4"])
    assert cluster.poll([handle])[handle.job_id].state in ("PENDING", "RUNNING")
    old = cluster._ssh().client().get_transport()
    assert old is not None
    old.sock.shutdown(socket.SHUT_RDWR)  # the network drops the connection under the client
    assert cluster.poll([handle])[handle.job_id].state in ("PENDING", "RUNNING", "COMPLETED")
    assert cluster._ssh().client().get_transport() is not old
    assert cluster.submit_command(k, ["sleep", "4"]) == handle  # a retried submit after the drop: adopted
    assert cluster.watch(handle, timeout_seconds=120).state == "COMPLETED"
    assert jobs_named(env, k) == [handle.job_id]


def test_failed_job_carries_exit_code_and_log_tail(cluster: SlurmCluster) -> None:
    handle = tiny(cluster, key("fail"), code=3)
    status = cluster.watch(handle, timeout_seconds=120)
    assert status.state == "FAILED" and status.exit_code == 3
    with pytest.raises(JobFailed, match="exit code 3") as info:
        cluster.result(handle, status)
    assert info.value.exit_code == 3 and "tiny job on" in info.value.log_tail


def test_trains_the_real_workload(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The digits example's code shipped to the cluster (once: a second job finds it there) and run from it."""
    k = key("train")
    code = code_of(DIGITS)
    job = TrainingJob(
        key=k,
        workdir=cluster.job_workdir(k),
        command=["python", "train.py"],
        code=code,
        env={contract.HPARAMS: json.dumps({"epochs": 2, "batch_size": 128}), "OMP_NUM_THREADS": "1"},
        resources=Resources(cpus_per_task=1, time_limit_minutes=10, mem_gb=2),
    )
    handle = cluster.submit(job)
    progress: list[dict] = []
    status = cluster.watch(handle, on_progress=progress.append, timeout_seconds=300)
    result = cluster.result(handle, status)
    final = posixpath.join(result.checkpoint_dir, contract.FINAL_DIRNAME)
    model = check_mlflow_model(remote_copy(cluster, final, tmp_path / contract.FINAL_DIRNAME))
    assert "pytorch" in model.flavors and model.serving_example
    assert progress and progress[-1]["step"] == progress[-1]["total_steps"]
    assert progress[-1]["metrics"]["val_accuracy"] > 0.5
    shipped = cluster.code_dir(code.sha256)
    assert remote_text(cluster, f"{shipped}/train.py") == (DIGITS / "train.py").read_bytes().decode()
    assert remote_exists(cluster, f"{shipped}/.complete")
    again = cluster.model_copy()  # another block (no memory of what it shipped) finds the code there

    def mtime() -> str:  # to the nanosecond: a directory unpacked again in the same second is another one
        return cluster.run(["stat", "-c", "%.9Y", "--", shipped])[1]

    before = mtime()
    assert again.ship_code(job) == shipped and mtime() == before


def test_local_mode_on_the_login_node(env: dict[str, str], login_node_dir: str) -> None:
    """The flow runs on the login node itself: the same block, no SSH."""
    # python: the login node's interpreter, which the flow running on it has; the login node is this machine here.
    local = SlurmCluster(
        local=True,
        slurm_conf=env["SLURM_CONF"],
        workdir_root=login_node_dir,
        python=sys.executable,
        poll_interval_start=0.3,
        poll_interval_max=2.0,
    )
    handle = tiny(local, key("local"))
    assert local.submit_command(handle.key, ["true"]) == handle
    status = local.watch(handle, timeout_seconds=120)
    assert status.state == "COMPLETED"
    assert "tiny job on" in local.read_log(handle)[0]
    assert local._session is None  # no SSH connection was made


def test_local_mode_jobs_do_not_get_the_orchestrators_environment(
    env: dict[str, str], login_node_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With local=True sbatch runs in this process's environment and exports it to the job: the commands get
    PATH, HOME, the locale, SLURM_CONF and pass_env only, never the orchestrator's credentials."""
    monkeypatch.setenv("PREFECT_API_KEY", "planted-prefect-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted-aws-secret")
    monkeypatch.setenv("GPUFERRY_TEST_PASSED", "passed-on-purpose")
    local = SlurmCluster(
        local=True,
        slurm_conf=env["SLURM_CONF"],
        workdir_root=login_node_dir,
        pass_env=["GPUFERRY_TEST_PASSED"],
        poll_interval_start=0.3,
        poll_interval_max=2.0,
    )
    handle = local.submit_command(key("localenv"), ["env"], env={"GIVEN": "by-the-job"})
    status = local.watch(handle, timeout_seconds=120)
    dumped = local.read_log(handle)[0]
    assert status.state == "COMPLETED", dumped
    names = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in dumped.splitlines() if "=" in line}
    assert names["GIVEN"] == "by-the-job" and names["GPUFERRY_TEST_PASSED"] == "passed-on-purpose"
    assert names["PATH"] == os.environ["PATH"] and names["SLURM_JOB_ID"] == handle.job_id
    assert "PREFECT_API_KEY" not in names and "AWS_SECRET_ACCESS_KEY" not in names
    assert "planted-prefect-key" not in dumped and "planted-aws-secret" not in dumped


def test_two_node_torchrun_all_reduce(cluster: SlurmCluster, env: dict[str, str]) -> None:
    """The generated torchrun line for real: 2 nodes, rendezvous on the first one, gloo all_reduce."""
    k = key("ddp")
    workdir = cluster.job_workdir(k)
    ddp = cluster
    job = TrainingJob(
        key=k,
        workdir=workdir,
        command=["python", "allreduce.py"],
        code=code_of(JOBS),
        env={"ALLREDUCE_OUT": workdir, "OMP_NUM_THREADS": "1"},
        resources=Resources(nodes=2, processes_per_node=1, mem_gb=1.5, time_limit_minutes=5),
    )
    handle = ddp.submit(job)
    output: list[str] = []
    status = ddp.watch(handle, on_output=output.append, timeout_seconds=300)
    assert status.state == "COMPLETED", f"{status}\n{ddp.log_tail(handle)}"
    ranks = [json.loads(remote_text(cluster, f"{workdir}/rank-{r}.json")) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank and seen["world_size"] == 2
        assert seen["sum"] == 3.0  # (0 + 1) + (1 + 1): both ranks contributed
        assert seen["ranks_seen"] == [0, 1]
    assert sorted(r["node"] for r in ranks) == ["n1", "n2"]  # one torchrun agent per node
    nodes = slurm(env, "sacct", "-X", "-n", "-P", "-j", handle.job_id, "--format=NodeList").split()
    assert nodes == ["n[1-2]"]
    assert "all_reduce sum 3.0" in "".join(output)


def test_a_job_that_waits_in_the_queue_past_its_time_limit_still_runs(cluster: SlurmCluster) -> None:
    """The watcher's limit is per running attempt (Slurm enforces --time itself): pending time does not count."""
    blocker = cluster.submit_command(key("blocker"), ["sleep", "12"])
    handle = tiny(cluster, key("queued"), dependency=f"afterany:{blocker.job_id}")
    seen: list[str] = []
    original = cluster.poll

    def poll(handles):  # type: ignore[no-untyped-def]
        statuses = original(handles)
        seen.extend(s.state for s in statuses.values())
        return statuses

    watcher = cluster.model_copy()
    object.__setattr__(watcher, "poll", poll)
    changes: list[JobStatus] = []
    # far less than the 12 s it waits behind the blocker
    status = watcher.watch(handle, timeout_seconds=4, on_state=changes.append)
    assert status.state == "COMPLETED", status
    assert seen.count("PENDING") >= 3, seen  # it did wait in the queue, past the limit, and was not cancelled
    # Each change was heard once, the scheduler's reason with it: not once per poll.
    assert len(changes) < len(seen) and changes[-1].state == "COMPLETED", changes
    waiting = [c for c in changes if c.state == "PENDING"]
    assert any("Slurm reason: Dependency" in c.reason for c in waiting), changes
    assert all(not c.nodes for c in waiting), changes


def test_a_running_job_names_its_node(cluster: SlurmCluster) -> None:
    """squeue's node list reaches the status of a running job (what `gpuferry runs` and the run's log show)."""
    handle = cluster.submit_command(key("where"), ["sleep", "30"])
    try:
        deadline = time.monotonic() + 120
        while (status := cluster.poll([handle])[handle.job_id]).state != "RUNNING":
            assert time.monotonic() < deadline and not status.terminal, status
            time.sleep(0.5)
        assert status.nodes in ("n1", "n2"), status
        assert status.summary().startswith(f"RUNNING on {status.nodes}"), status.summary()
    finally:
        cluster.cancel(handle)


def test_a_job_neither_squeue_nor_sacct_knows_is_lost_after_the_grace_a_fresh_one_is_seen_at_once(
    cluster: SlurmCluster,
) -> None:
    strict = cluster.model_copy(update={"lost_job_grace_seconds": 0.0})
    # Seen from its submission on (the controller has it before sbatch answers): no grace needed at all.
    fresh = tiny(strict, key("fresh"))
    assert strict.watch(fresh, timeout_seconds=120).state == "COMPLETED"
    # A job id this cluster never had: what a controller that lost its state, or a purged record, leaves.
    gone = fresh.model_copy(update={"job_id": "987654321", "key": key("gone")})
    unseen = cluster.poll([gone])[gone.job_id]
    assert unseen.state == "PENDING" and not unseen.visible
    with pytest.raises(
        JobFailed,
        match=r"job 987654321 is lost: .*lost_job_grace_seconds=1\).*Neither squeue nor "
        r"sacct knows job 987654321.*sacct -D -j 987654321",
    ):
        cluster.model_copy(update={"lost_job_grace_seconds": 1.0}).watch(gone, timeout_seconds=120)


@pytest.mark.usefixtures("prefect_server")
def test_workload_secrets_reach_the_job_through_a_0600_file_removed_when_it_ends(cluster: SlurmCluster) -> None:
    """A workload's secret (a Prefect Secret block) and the tracking server's login the pipeline hands the job."""
    from prefect.blocks.system import Secret
    from pydantic import SecretStr

    planted, password = f"planted-{uuid.uuid4().hex}", f"planted-pw-{uuid.uuid4().hex}"
    Secret(value=planted).save("slurm-job-token", overwrite=True)
    k = key("secret")
    probe = (
        "import os, pathlib; s = os.environ['API_TOKEN']; p = os.environ['MLFLOW_TRACKING_PASSWORD']; "
        "print('token', len(s), s == open(os.environ['EXPECT']).read().strip(), flush=True); "
        "print('login', len(p), p == open(os.environ['EXPECT'] + '.pw').read().strip(), flush=True); "
        "p = pathlib.Path(os.environ['CHECKPOINT_DIR']).parent / '.secret.env'; "
        "print('mode', oct(p.stat().st_mode & 0o777))"
    )
    expect = f"{cluster.workdir_root}/{k}.expected"  # what the job compares its values with, on the cluster
    cluster.write_private(expect, planted.encode())
    cluster.write_private(f"{expect}.pw", password.encode())
    job = TrainingJob(
        key=k,
        workdir=cluster.job_workdir(k),
        command=["python", "-c", probe],
        code=code_of(JOBS),
        env={"EXPECT": expect},
        secrets={"API_TOKEN": "slurm-job-token"},
        secret_env={"MLFLOW_TRACKING_PASSWORD": SecretStr(password)},
        resources=Resources(time_limit_minutes=5),
    )
    handle = cluster.submit(job)
    status = cluster.watch(handle, timeout_seconds=120)
    log = cluster.read_log(handle)[0]
    assert status.state == "COMPLETED", log
    assert f"token {len(planted)} True" in log and f"login {len(password)} True" in log and "mode 0o600" in log
    script = remote_text(cluster, f"{job.workdir}/job.sbatch")
    assert planted not in script and planted not in log and "API_TOKEN" not in script.split(". /")[0]
    assert password not in script and password not in log and "MLFLOW_TRACKING_PASSWORD" not in script.split(". /")[0]
    assert not remote_exists(cluster, f"{job.workdir}/.secret.env")  # the job completed: it removed its secrets itself
    cluster.result(handle, status)  # the orchestrator's removal (for any other end) finds nothing left
    assert not remote_exists(cluster, f"{job.workdir}/.secret.env")


def test_cancel_removes_the_jobs_secret_and_login_files(cluster: SlurmCluster) -> None:
    """A cancelled job never starts again: its secrets (and the registry login a job in an image gets) go."""
    from pydantic import SecretStr

    from blocks.slurm.containers import ENROOT_CREDENTIALS_NAME, REGISTRY_AUTH_NAME

    k = key("cancelsecret")
    handle = cluster.submit_command(
        k, ["sh", "-c", 'echo "token ${#API_TOKEN}"; sleep 300'], secret_env={"API_TOKEN": SecretStr("s3cr3t-token")}
    )
    for name in (REGISTRY_AUTH_NAME, ENROOT_CREDENTIALS_NAME):  # as the container runtimes' logins are written
        cluster.write_private(f"{handle.workdir}/{name}", b"registry login")
    wait_for(lambda: "token 12" in cluster.read_log(handle)[0], 120, "the job running with its secret")
    secrets = [f"{handle.workdir}/{name}" for name in (".secret.env", REGISTRY_AUTH_NAME, ENROOT_CREDENTIALS_NAME)]
    assert cluster.run(["stat", "-c", "%a", "--", *secrets])[1].split() == ["600"] * len(secrets)  # all there, 0600
    cluster.cancel(handle)
    assert [posixpath.basename(path) for path in secrets if remote_exists(cluster, path)] == []
    wait_for(lambda: cluster.poll([handle])[handle.job_id].state == "CANCELLED", 60, "the job cancelled")


def test_the_cluster_stores_the_trained_model_itself(cluster: SlurmCluster, s3_store) -> None:  # type: ignore[no-untyped-def]
    """store_model over SSH: the login node runs gpuferry's runtime (shipped once) against the store; the checkpoint's
    URI and sha256 come back, its bytes never pass through this process; the settings file is gone after."""
    import hashlib

    from blocks.base.mlflow_model import NoModel

    k = key("store")
    checkpoints = f"{cluster.job_workdir(k)}/checkpoints"
    final = f"{checkpoints}/final"
    mlmodel = b"flavors:\n  python_function: {loader_module: mlflow.sklearn}\n  sklearn: {}\n"
    cluster.write_private(f"{final}/MLmodel", mlmodel)
    cluster.write_private(f"{final}/model.bin", b"w" * 10_000)
    info = cluster.inspect_model(final)
    assert info.pyfunc and info.flavors == ["python_function", "sklearn"]
    ref = cluster.store_model(final, s3_store, f"m/{k}")
    assert ref.uri == s3_store.uri_of(f"m/{k}") and ref.files == 2 and ref.bytes_uploaded == 10_000 + len(mlmodel)
    manifest = s3_store.read_manifest(ref.uri)
    assert sorted(e["path"] for e in manifest["files"]) == ["MLmodel", "model.bin"]
    raw = s3_store.read_file(ref.uri, "model.bin")
    assert raw == b"w" * 10_000 and hashlib.sha256(raw).hexdigest() == manifest["files"][1]["sha256"]
    # the 0600 settings file went with the command
    assert cluster.run(["find", checkpoints, "-maxdepth", "1", "-name", ".store-*"])[1] == ""
    again = cluster.store_model(final, s3_store, f"m/{k}")  # unchanged: nothing sent
    assert again.sha256 == ref.sha256 and again.bytes_uploaded == 0
    empty = f"{checkpoints}/empty"
    cluster.run(["mkdir", "--", empty])
    with pytest.raises(NoModel, match="holds no MLflow model"):
        cluster.inspect_model(empty)
