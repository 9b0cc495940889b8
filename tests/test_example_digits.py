"""The digits example's train.py, run as the backends run it: a subprocess configured by the environment,
leaving an MLflow model in CHECKPOINT_DIR/final/."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from blocks.base.mlflow_model import check_mlflow_model
from runtime import contract
from tests.examples import DIGITS, example_module

TRAIN = DIGITS / "train.py"
TRAINING_STATE_FILENAME = example_module(DIGITS, "train").TRAINING_STATE_FILENAME
MODEL_FILENAME = "model.pt"  # the weights in each step-* checkpoint
# Per job and per wait: far more than a job takes (10-20 s) even on a busy 2-core machine.
DEADLINE_S = 300.0
JOB_VARIABLES = {
    contract.CHECKPOINT_DIR,
    contract.CHECKPOINT_EVERY,
    contract.HPARAMS,
    contract.PROGRESS_FILE,
    contract.MLFLOW_TRACKING_URI,
    contract.MLFLOW_RUN_ID,
    contract.RANK,
    contract.WORLD_SIZE,
    contract.LOCAL_RANK,
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
}

# With the default hparams (seed 0) the job measured val_accuracy 0.955, test_accuracy 0.955.
MIN_ACCURACY = 0.95
TOTAL_STEPS = 20 * 20  # 20 epochs of ceil(1259 / 64) batches
# Checkpointing this often stretches the default run to a few seconds, which leaves time
# to interrupt it between its first checkpoint and its end.
FREQUENT = 5


class Job:
    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def wait(self) -> int:
        return self.proc.wait(timeout=DEADLINE_S)

    @property
    def log(self) -> str:
        return self.log_path.read_text()


class Jobs:
    """Starts train.py jobs sharing one checkpoint directory; kills leftovers on close."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.env = env
        self.workdir = workdir
        self.checkpoints = workdir / "checkpoints"
        self.progress = workdir / "progress.json"
        self.final = self.checkpoints / contract.FINAL_DIRNAME
        self._started: list[Job] = []

    def start(
        self,
        hparams: dict[str, Any],
        *,
        checkpoint_every: int | None = None,
        extra_env: dict[str, str] | None = None,
        nproc: int = 1,
    ) -> Job:
        env = {
            **self.env,
            contract.HPARAMS: json.dumps(hparams),
            contract.CHECKPOINT_DIR: str(self.checkpoints),
            contract.PROGRESS_FILE: str(self.progress),
            **(extra_env or {}),
        }
        if checkpoint_every is not None:
            env[contract.CHECKPOINT_EVERY] = str(checkpoint_every)
        cmd = [sys.executable, str(TRAIN)]
        if nproc > 1:
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        log_path = self.workdir / f"job-{len(self._started)}.log"
        with open(log_path, "wb") as log:
            # A session of its own, so that close() can also kill torchrun's workers.
            proc = subprocess.Popen(
                cmd, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        job = Job(proc, log_path)
        self._started.append(job)
        return job

    def run(self, hparams: dict[str, Any], **kwargs: Any) -> Job:
        job = self.start(hparams, **kwargs)
        job.wait()
        return job

    def read_progress(self) -> dict[str, Any]:
        return json.loads(self.progress.read_text())

    def close(self) -> None:
        for job in self._started:
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()


@pytest.fixture(scope="session")
def job_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    # Every job spends most of its time importing torch and scikit-learn: a bytecode cache
    # shared by the jobs, kept outside the source tree, makes their start about 3x faster.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path_factory.mktemp("pycache"))
    return env


@pytest.fixture
def jobs(job_env: dict[str, str], tmp_path: Path) -> Iterator[Jobs]:
    started = Jobs(job_env, tmp_path)
    yield started
    started.close()


@pytest.fixture(scope="module")
def default_run(job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Jobs, Job]]:
    """An uninterrupted run with the default hparams and CHECKPOINT_EVERY."""
    started = Jobs(job_env, tmp_path_factory.mktemp("default-run"))
    yield started, started.run({})
    started.close()


def wait_until(condition: Callable[[], bool], job: Job, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert job.proc.poll() is None, f"job exited ({job.proc.returncode}) before {what}:\n{job.log}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE_S} s:\n{job.log}"
        time.sleep(0.02)


def step_checkpoints(root: Path) -> list[int]:
    """Steps of the ``step-*`` checkpoints under ``root`` (a rename makes each one appear whole)."""
    if not root.exists():
        return []
    pattern = re.compile(re.escape(contract.CHECKPOINT_PREFIX) + r"(\d{8})")
    return sorted(int(m[1]) for p in root.iterdir() if (m := pattern.fullmatch(p.name)))


def read_metrics(jobs: Jobs) -> dict[str, Any]:
    """The final metrics the job reported (its last progress record)."""
    return jobs.read_progress()["metrics"]


def final_model(final: Path) -> torch.nn.Module:
    """The MLflow model the job saved, as the PyTorch module it holds."""
    import mlflow.pytorch

    return mlflow.pytorch.load_model(str(final))


def assert_same_model(jobs: Jobs, reference: Jobs) -> None:
    """Resuming must reproduce the uninterrupted run exactly."""
    got, want = final_model(jobs.final), final_model(reference.final)
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs from the uninterrupted run"
    assert read_metrics(jobs) == read_metrics(reference)


def resumed_step(log: str) -> int:
    match = re.search(r"resumed from step-(\d{8}): step (\d+)", log)
    assert match, log
    assert int(match[1]) == int(match[2])
    return int(match[2])


def test_unknown_hparam_exits_2_naming_it(jobs: Jobs) -> None:
    job = jobs.run({"epochs": 1, "learning_rate": 0.1})
    assert job.proc.returncode == 2, job.log
    assert "learning_rate" in job.log
    assert "valid keys: epochs, lr, batch_size, hidden, dropout, seed, optimizer" in job.log
    assert not jobs.checkpoints.exists()


def test_trains_to_completion(default_run: tuple[Jobs, Job]) -> None:
    jobs, job = default_run
    assert job.proc.returncode == contract.EXIT_OK, job.log
    assert len(re.findall(r"^epoch \d+/20 step \d+/400 train_loss=\S+ val_accuracy=\S+", job.log, re.M)) == 20

    metrics = read_metrics(jobs)
    assert metrics["step"] == TOTAL_STEPS and metrics["epochs"] == 20
    assert metrics["val_accuracy"] >= MIN_ACCURACY and metrics["test_accuracy"] >= MIN_ACCURACY
    assert 0 < metrics["val_loss"] < 0.5

    # final/ is an MLflow model (gpuferry's contract) with a serving input example, answering probabilities.
    info = check_mlflow_model(jobs.final)
    assert info.pyfunc and "pytorch" in info.flavors and info.signature and info.serving_example
    import mlflow.pyfunc

    probabilities = mlflow.pyfunc.load_model(str(jobs.final)).predict(torch.zeros(3, 64).numpy())
    assert probabilities.shape == (3, 10) and abs(float(probabilities.sum()) - 3.0) < 1e-4
    # It holds the weights of the last step.
    model = final_model(jobs.final)
    last = torch.load(jobs.checkpoints / "step-00000400" / MODEL_FILENAME, weights_only=True)
    assert last["config"] == {"hidden": 128, "dropout": 0.0}
    for name, value in last["state_dict"].items():
        assert torch.equal(value, model.state_dict()[f"0.{name}"])  # the network inside (network, softmax)

    # The two newest checkpoints are kept, no temporaries are left, no ./mlruns appears.
    assert sorted(p.name for p in jobs.checkpoints.iterdir()) == ["final", "step-00000350", "step-00000400"]
    assert not (jobs.workdir / "mlruns").exists()

    progress = jobs.read_progress()
    assert progress["step"] == progress["total_steps"] == TOTAL_STEPS
    assert progress["epoch"] == 20
    assert progress["metrics"]["test_accuracy"] == metrics["test_accuracy"]


def test_resumes_after_sigkill(jobs: Jobs, default_run: tuple[Jobs, Job]) -> None:
    first = jobs.start({}, checkpoint_every=FREQUENT)
    wait_until(lambda: bool(step_checkpoints(jobs.checkpoints)), first, "step checkpoint")
    first.proc.kill()
    assert first.wait() == -signal.SIGKILL, "the job finished before it could be killed:\n" + first.log
    newest = step_checkpoints(jobs.checkpoints)[-1]

    second = jobs.run({}, checkpoint_every=FREQUENT)
    assert second.proc.returncode == contract.EXIT_OK, second.log
    resumed = resumed_step(second.log)
    assert resumed == newest > 0
    trained = TOTAL_STEPS - resumed
    assert f"finished: step {TOTAL_STEPS}/{TOTAL_STEPS}, trained {trained} steps in this run" in second.log
    assert jobs.read_progress()["step"] == TOTAL_STEPS
    assert not list(jobs.checkpoints.glob(".tmp-*"))
    assert_same_model(jobs, default_run[0])


def test_sigterm_then_rerun_logs_into_the_given_mlflow_run(jobs: Jobs, default_run: tuple[Jobs, Job]) -> None:
    """The requeue cycle of a preempted job, attached to the pipeline's MLflow run.

    (One scenario for both: creating the MLflow database takes the better part of the
    time, and a resumed attempt is where logging into an existing run can go wrong.)
    """
    from mlflow import MlflowClient

    uri = f"sqlite:///{jobs.workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("train")
    run_id = client.create_run(experiment_id).info.run_id
    mlflow_env = {contract.MLFLOW_TRACKING_URI: uri, contract.MLFLOW_RUN_ID: run_id}

    first = jobs.start({}, checkpoint_every=FREQUENT, extra_env=mlflow_env)
    wait_until(lambda: bool(step_checkpoints(jobs.checkpoints)), first, "step checkpoint")
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait() == contract.EXIT_PREEMPTED, first.log
    match = re.search(r"preempted: saved checkpoint at step (\d+)/", first.log)
    assert match, first.log
    saved = int(match[1])
    assert step_checkpoints(jobs.checkpoints)[-1] == saved
    assert (jobs.checkpoints / f"step-{saved:08d}" / TRAINING_STATE_FILENAME).is_file()
    assert not jobs.final.exists()
    assert client.get_run(run_id).info.status == "KILLED"

    # The rerun resumes where the first attempt stopped and logs the same params again.
    second = jobs.run({}, checkpoint_every=FREQUENT, extra_env=mlflow_env)
    assert second.proc.returncode == contract.EXIT_OK, second.log
    assert resumed_step(second.log) == saved
    assert_same_model(jobs, default_run[0])

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "epochs": "20",
        "lr": "0.05",
        "batch_size": "64",
        "hidden": "128",
        "dropout": "0.0",
        "seed": "0",
        "optimizer": "sgd",
    }
    assert run.data.tags["world_size"] == "1"
    # Each epoch is evaluated once, by whichever attempt finished it.
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(20, TOTAL_STEPS + 1, 20))
    assert max(history, key=lambda m: m.step).value == read_metrics(jobs)["val_accuracy"]
    assert run.data.metrics["test_accuracy"] == read_metrics(jobs)["test_accuracy"]
    # Both attempts attached to the given run instead of creating their own.
    assert [r.info.run_id for r in client.search_runs([experiment_id, "0"])] == [run_id]


def test_two_process_torchrun(jobs: Jobs) -> None:
    job = jobs.run({"epochs": 3}, checkpoint_every=7, nproc=2)
    assert job.proc.returncode == contract.EXIT_OK, job.log
    assert "world size 2" in job.log
    assert len(re.findall(r"^epoch \d/3 ", job.log, re.M)) == 3  # only rank 0 logs

    assert read_metrics(jobs)["step"] == 60
    assert check_mlflow_model(jobs.final).pyfunc
    assert step_checkpoints(jobs.checkpoints) == [49, 56]
    state = torch.load(jobs.checkpoints / "step-00000056" / TRAINING_STATE_FILENAME, weights_only=True)
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert jobs.read_progress()["step"] == 60


def test_preempted_under_torchrun_leaves_the_marker(jobs: Jobs) -> None:
    """torchrun exits 1 when a worker exits 75; the marker in CHECKPOINT_DIR tells the backend why."""
    first = jobs.start({}, checkpoint_every=FREQUENT, nproc=2)
    wait_until(lambda: bool(step_checkpoints(jobs.checkpoints)), first, "step checkpoint")
    first.proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler does
    assert first.wait() != contract.EXIT_OK, first.log
    assert "preempted: saved checkpoint" in first.log, "the job finished before it could be preempted:\n" + first.log
    assert (jobs.checkpoints / contract.PREEMPTED_MARKER).exists()

    second = jobs.run({}, checkpoint_every=FREQUENT, nproc=2)
    assert second.proc.returncode == contract.EXIT_OK, second.log
    assert resumed_step(second.log) > 0
    assert not (jobs.checkpoints / contract.PREEMPTED_MARKER).exists()
