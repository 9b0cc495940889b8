"""The sbatch script builder (pure): golden files, validation, quoting. No cluster needed.

Regenerate the golden files after an intended change with GPUFERRY_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks.errors import ConfigurationError
from blocks.records import CodeRef, TrainingJob
from blocks.slurm.cluster import SlurmCluster
from blocks.slurm.script import SBATCH_OPTIONS, sbatch_script
from blocks.slurm.state import map_state, sacct_exit, wait_status_to_exit
from blocks.specs import Resources
from tests.golden_files import GOLDEN, check_text

CASES = {
    "single": {
        "command": ["python3", "-c", "print('hello')"],
        "workdir": "/shared/jobs/single",
        "job_name": "single",
        "comment": "gpuferry-key:single",
        "output": "/shared/jobs/single/job.log",
        "time": 30,
    },
    "gpus_env_signal": {
        "command": ["/opt/venv/bin/python", "/code/workload/train.py"],
        "workdir": "/shared/jobs/k1",
        "job_name": "k1",
        "partition": "gpu",
        "account": "research",
        "qos": "high",
        "gpus_per_node": 2,
        "cpus_per_task": 4,
        "mem": "16G",
        "time": 24 * 60 + 90,
        "signal": "B:USR1@90",
        "requeue": True,
        "output": "/shared/jobs/k1/job.log",
        "env": {"HPARAMS": '{"epochs": 3, "lr": 0.1}', "CHECKPOINT_DIR": "/shared/jobs/k1/checkpoints"},
        "requeue_exit_code": 75,
        "max_requeues": 3,
        "secret_env_file": "/shared/jobs/k1/.secret.env",
        "additional": {"constraint": "a100", "exclusive": True},
    },
    "array": {
        "command": ["bash", "-c", 'echo "task $SLURM_ARRAY_TASK_ID"'],
        "workdir": "/shared/jobs/sweep",
        "job_name": "sweep",
        "array": "0-999",
        "array_parallelism": 64,
        "dependency": "afterok:41:42",
        "output": "/shared/jobs/sweep/task-%a.log",
        "gres": "gpu:1",
        "open_mode": "truncate",
    },
    "torchrun_multinode": {
        "command": ["python3", "/code/workload/train.py", "--flag", "a b"],
        "workdir": "/shared/jobs/ddp",
        "job_name": "ddp",
        "nodes": 2,
        "ntasks_per_node": 1,
        "gpus_per_node": 4,
        "torchrun_nproc_per_node": 4,
        "rdzv_port": 29555,
        "rdzv_port_span": 100,
        "output": "/shared/jobs/ddp/job.log",
        "requeue": False,
    },
    "torchrun_program": {  # a program that is not Python: torchrun starts it with --no-python
        "command": ["bash", "launch.sh", "--epochs", "3"],
        "workdir": "/shared/jobs/prog",
        "cwd": "/shared/code/abc",
        "job_name": "prog",
        "torchrun_nproc_per_node": 2,
        "torchrun_python": "/opt/venv/bin/python",
        "output": "/shared/jobs/prog/job.log",
    },
}


def check_golden(name: str, text: str) -> None:
    check_text(GOLDEN / f"{name}.sbatch", text)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_scripts(name: str) -> None:
    case = dict(CASES[name])
    text = sbatch_script(case.pop("command"), **case)
    check_golden(name, text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def training_cluster() -> SlurmCluster:
    return SlurmCluster(
        host="login.example",
        user="alice",
        workdir_root="/shared/jobs",
        python="/opt/venv/bin/python",
        account="research",
        qos="normal",
    )


CODE = CodeRef(root="/home/alice/models", archive="/tmp/code.tar.gz", sha256="ab" * 32)
CODE_DIR = "/shared/jobs/.code/" + "ab" * 12  # where the cluster unpacks CODE


def test_golden_training_job_script() -> None:
    job = TrainingJob(
        key="run-42-train",
        workdir="/shared/jobs/run-42-train",
        command=["python", "train.py", "--fast"],
        env={"HPARAMS": '{"epochs": 2}'},
        code=CODE,
        resources=Resources(
            nodes=2,
            processes_per_node=2,
            gpus_per_node=2,
            cpus_per_task=2,
            mem_gb=8,
            time_limit_minutes=120,
            partition="gpu",
            max_requeues=2,
        ),
    )
    text = training_cluster()._script_for_job(job)
    check_golden("training_job", text)
    assert "--comment=gpuferry-key:run-42-train" in text and "--job-name=run-42-train" in text
    assert f"cd {CODE_DIR} || exit 1" in text  # the job runs from the workload's code, shipped there
    single = training_cluster()._script_for_job(job.model_copy(update={"resources": Resources()}))
    assert "srun" not in single and "torch.distributed.run" not in single  # one process: run directly
    assert "/opt/venv/bin/python train.py --fast &" in single
    own = training_cluster()._script_for_job(job.model_copy(update={"python": "/envs/ml/bin/python"}))
    assert "/envs/ml/bin/python -m torch.distributed.run" in own  # the workload's environment.python wins


def test_a_runs_account_qos_and_nice_win_over_the_stacks() -> None:
    """The stack's account and QoS are the defaults; a run's own (training.resources) replace them, and its nice
    replaces the stack's additional nice. Refused before anything is sent when not a Slurm name."""
    job = TrainingJob(key="k", workdir="/shared/jobs/k", command=["python", "train.py"], code=CODE)
    cluster = training_cluster().model_copy(update={"additional_directives": {"nice": "5", "exclusive": True}})
    text = cluster._script_for_job(job)
    assert "#SBATCH --account=research" in text and "#SBATCH --qos=normal" in text and "#SBATCH --nice=5" in text
    own = Resources(account="sweeps", qos="preemptible", nice=100)
    text = cluster._script_for_job(job.model_copy(update={"resources": own}))
    assert "#SBATCH --account=sweeps" in text and "#SBATCH --qos=preemptible" in text
    assert "#SBATCH --nice=100" in text and "--nice=5" not in text and "#SBATCH --exclusive" in text
    assert "research" not in text and "--qos=normal" not in text
    for field, bad in (("qos", "low;rm -rf /"), ("account", "a b")):
        with pytest.raises(ValidationError, match=field):
            Resources(**{field: bad})


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="unknown sbatch option.*gpus_per_nod\\b") as info:
        sbatch_script(["true"], workdir="/w", gpus_per_nod=2)
    for name in SBATCH_OPTIONS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("job_name", "x; rm -rf /", "job_name="),
        ("job_name", "$(id)", "job_name="),
        ("job_name", "a b", "job_name="),
        ("partition", "gpu`id`", "partition="),
        ("account", "", "account="),
        ("qos", "high\nx", "qos="),
        ("nodes", 0, "nodes=0"),
        ("gpus_per_node", -1, "gpus_per_node=-1"),
        ("cpus_per_task", True, "cpus_per_task=True"),
        ("mem", "4 G", "mem="),
        ("time", "1 day", "time="),
        ("output", "relative/log", "output="),
        ("output", "/tmp/a b", "output="),
        ("comment", "a'b", "comment="),
        ("array", "0-9;id", "array="),
        ("dependency", "afterok:1;id", "dependency="),
        ("signal", "USR1@90;id", "signal="),
        ("signal", "BOGUS@90", "signal="),
        ("requeue", "yes", "requeue="),
        ("open_mode", "write", "open_mode="),
    ],
)
def test_bad_values_are_rejected_naming_the_option(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("$", "\\$").replace("(", "\\(")):
        sbatch_script(["true"], workdir="/w", **{option: value})


def test_option_combinations() -> None:
    with pytest.raises(ConfigurationError, match="either gpus_per_node or gres"):
        sbatch_script(["true"], workdir="/w", gpus_per_node=1, gres="gpu:1")
    with pytest.raises(ConfigurationError, match="array_parallelism needs array"):
        sbatch_script(["true"], workdir="/w", array_parallelism=4)
    with pytest.raises(ConfigurationError, match="not in the allow-list.*constraint"):
        sbatch_script(["true"], workdir="/w", additional={"uid": "0"})
    with pytest.raises(ConfigurationError, match="additional\\['constraint'\\]"):
        sbatch_script(["true"], workdir="/w", additional={"constraint": "a100 && x"})
    with pytest.raises(ConfigurationError, match="env\\['A-B'\\]"):
        sbatch_script(["true"], workdir="/w", env={"A-B": "1"})
    with pytest.raises(ConfigurationError, match="command="):
        sbatch_script([], workdir="/w")
    torchrun = {"workdir": "/w", "nodes": 2, "torchrun_nproc_per_node": 1}
    with pytest.raises(ConfigurationError, match="rdzv_port_span=2000.*from 1 to 1536"):
        sbatch_script(["python3", "t.py"], rdzv_port=64000, rdzv_port_span=2000, **torchrun)


def test_rendezvous_port_follows_the_job_id() -> None:
    """Two multi-node jobs whose first node is the same host get different ports."""
    text = sbatch_script(["python3", "t.py"], workdir="/w", nodes=2, torchrun_nproc_per_node=1, rdzv_port=29500)
    line = next(x for x in text.splitlines() if x.startswith("export MASTER_PORT="))
    ports = [
        subprocess.run(
            ["bash", "-c", f'{line}; echo "$MASTER_PORT"'],
            capture_output=True,
            text=True,
            check=True,
            env={"SLURM_JOB_ID": job_id},
        ).stdout.strip()
        for job_id in ("41", "42", "1041")
    ]
    assert ports == ["29541", "29542", "29541"]


def test_values_cannot_escape_their_quotes(tmp_path: Path) -> None:
    """Run the generated body with bash: hostile values arrive verbatim and execute nothing."""
    hostile = "'; touch pwned-env; echo '$(touch pwned-subst)`touch pwned-tick`"
    text = sbatch_script(
        [
            "python3",
            "-c",
            "import os, sys; print(repr(sys.argv[1])); print(repr(os.environ['HOSTILE']))",
            "$(touch pwned-arg) a b",
        ],
        workdir=str(tmp_path),
        env={"HOSTILE": hostile},
    )
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [repr("$(touch pwned-arg) a b"), repr(hostile)]
    assert not list(tmp_path.glob("pwned*"))


def test_exit_code_and_warning_signal_reach_the_program(tmp_path: Path) -> None:
    """The batch shell forwards USR1 to the program and returns its exit code (here: 75 after USR1)."""
    program = (
        "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75)); "
        "print('ready', flush=True); time.sleep(60); sys.exit(0)"
    )
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(["python3", "-c", program], workdir=str(tmp_path)))
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(10)  # SIGUSR1, as `--signal=B:USR1@90` sends it to the batch shell
    assert proc.wait(timeout=30) == 75


def test_secrets_are_sourced_not_inlined() -> None:
    text = sbatch_script(["true"], workdir="/w", secret_env_file="/w/.secret.env", env={"PUBLIC": "1"})
    assert ". /w/.secret.env" in text and "export PUBLIC=1" in text


@pytest.mark.parametrize(
    ("slurm", "requeue", "ours", "terminal"),
    [
        ("PENDING", True, "PENDING", False),
        ("RUNNING", True, "RUNNING", False),
        ("COMPLETING", True, "RUNNING", False),
        ("PREEMPTED", True, "PREEMPTED", False),
        ("PREEMPTED", False, "FAILED", True),
        ("REQUEUED", True, "REQUEUED", False),
        ("NODE_FAIL", True, "REQUEUED", False),
        ("NODE_FAIL", False, "FAILED", True),
        ("COMPLETED", True, "COMPLETED", True),
        ("FAILED", True, "FAILED", True),
        ("CANCELLED by 0", True, "CANCELLED", True),
        ("TIMEOUT", True, "TIMEOUT", True),
        ("OUT_OF_MEMORY", True, "OUT_OF_MEMORY", True),
        ("BOOT_FAIL", True, "FAILED", True),
    ],
)
def test_state_mapping(slurm: str, requeue: bool, ours: str, terminal: bool) -> None:
    from blocks.records import TERMINAL_STATES

    state, reason = map_state(slurm, requeue=requeue, exit_code=None)
    assert state == ours and (state in TERMINAL_STATES) == terminal
    if ours in ("TIMEOUT", "OUT_OF_MEMORY"):
        assert "raise resources." in reason


def test_exit_codes() -> None:
    assert wait_status_to_exit(3 << 8) == 3 and wait_status_to_exit(9) == 137 and wait_status_to_exit(0) == 0
    assert sacct_exit("3:0") == 3 and sacct_exit("0:15") == 143 and sacct_exit("") is None


def _run_with_fake_scontrol(tmp_path: Path, signal_number: int) -> tuple[int, str, list[str]]:
    """Run a requeueable job script under bash with a recording `scontrol`; send it one signal."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    program = (
        "import signal, sys, time; [signal.signal(s, lambda *a: sys.exit(75)) for s in "
        "(signal.SIGUSR1, signal.SIGTERM)]; print('ready', flush=True); time.sleep(60)"
    )
    script = tmp_path / "job.sbatch"
    script.write_text(
        sbatch_script(
            ["python3", "-c", program], workdir=str(tmp_path), requeue=True, requeue_exit_code=75, max_requeues=3
        )
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal_number)
    rc = proc.wait(timeout=30)
    out = proc.stdout.read()
    return rc, out, calls.read_text().splitlines() if calls.exists() else []


def test_warning_signal_exit_requeues_the_job_itself(tmp_path: Path) -> None:
    rc, out, calls = _run_with_fake_scontrol(tmp_path, 10)  # SIGUSR1: the time-limit warning
    assert rc == 75 and calls == ["requeue 77"], out


def test_term_from_slurm_does_not_requeue_a_second_time(tmp_path: Path) -> None:
    """Preemption (PreemptMode=REQUEUE) or scancel sends TERM: Slurm decides; the script must not requeue."""
    rc, out, calls = _run_with_fake_scontrol(tmp_path, 15)
    assert rc == 75 and calls == [], out
    assert "Slurm requeues it if it was preempted" in out


def test_golden_sweep_array_script(tmp_path: Path) -> None:
    """A sweep: one array task per configuration, each exporting its entry of tasks.json."""
    job = TrainingJob(
        key="run-42-sweep",
        workdir="/shared/jobs/run-42-sweep",
        command=["python", "train.py"],
        env={"CHECKPOINT_EVERY": "20"},
        code=CODE,
        resources=Resources(gpus_per_node=1, mem_gb=2),
    )
    text = training_cluster()._script_for_job(job, array_size=6, parallelism=2)
    check_golden("sweep_array", text)
    assert "#SBATCH --array=0-5%2" in text and "CHECKPOINT_DIR" not in text  # per task, from tasks/<i>.env
    # The body really exports the words of tasks/$SLURM_ARRAY_TASK_ID.env, hostile values verbatim.
    hostile = "'; touch pwned; $(touch pwned2) `x`\nline 2 \\"
    (tmp_path / "tasks").mkdir()
    for i in range(6):
        (tmp_path / "tasks" / f"{i}.env").write_bytes(f"HPARAMS={hostile}{i}\0CHECKPOINT_DIR=/c/{i}\0".encode())
    body = (
        text.replace("/shared/jobs/run-42-sweep", str(tmp_path))
        .replace(CODE_DIR, str(tmp_path))
        .replace(
            "/opt/venv/bin/python train.py",
            f"{sys.executable} -c 'import json, os; "
            'print(json.dumps([os.environ["HPARAMS"], os.environ["CHECKPOINT_DIR"]]))\'',
        )
    )
    proc = subprocess.run(
        ["bash", "-c", body],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "SLURM_ARRAY_TASK_ID": "4"},
    )
    assert proc.returncode == 0 and json.loads(proc.stdout) == [f"{hostile}4", "/c/4"], proc.stderr
    assert not list(tmp_path.glob("pwned*"))
    missing = subprocess.run(
        ["bash", "-c", body],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "SLURM_ARRAY_TASK_ID": "9"},
    )
    assert missing.returncode == 1 and "array task 9: cannot read its settings" in missing.stderr


def test_jobs_on_a_remote_cluster_need_a_tracking_server_they_reach() -> None:
    """A file-backed tracking URI is this machine's: the cluster's jobs could not log to it."""
    cluster = training_cluster()
    for uri in ("sqlite:////home/me/mlflow.db", "file:///home/me/mlruns", "/home/me/mlruns"):
        with pytest.raises(ConfigurationError, match=r"tracking.tracking_uri=.*MLflow server the cluster reaches"):
            cluster.check_tracking(uri)
    cluster.check_tracking("https://mlflow.example.org")
    cluster.model_copy(update={"local": True}).check_tracking("sqlite:////home/me/mlflow.db")  # on the login node
