"""Compute backends: where a training job runs.

``ComputeBackend`` is the interface every backend implements (local processes here; Slurm over SSH
in ``blocks/slurm.py``):

* ``submit(job)`` starts the job, or adopts the job that already carries ``job.key`` — a retried
  submit never creates a second job;
* ``poll(handles)`` reads the state of many jobs in one query;
* ``cancel(handle)``, ``read_log(handle, offset)``, ``read_progress(handle)``;
* ``watch(handle, ...)`` polls until the job is terminal, starting fast and backing off, and polls
  on through an outage of the backend (a ``TransientError``: the job keeps running) for up to
  ``outage_tolerance_seconds``. A backend only has to raise its passing errors as ``TransientError``.
  Its time limit counts what a scheduler counts: the time the current attempt has been RUNNING, not
  time spent pending, preempted or requeued. A backend whose scheduler enforces the limit itself
  (``enforces_time_limit``: Slurm's ``--time``) is never cancelled by the watcher for time. Nothing else
  bounds the wait but a lost job: one the backend has had no record of (``JobStatus.visible`` False) for
  ``lost_job_grace_seconds`` (``blocks/watchdog.py``, whose rules the job watcher applies too).

Preempted jobs (exit code ``EXIT_PREEMPTED`` of the contract) are requeued by the backend up to
``resources.max_requeues`` times, and resume from their last checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from prefect.blocks.core import Block
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from pydantic import Field

from blocks import _job_runner
from blocks._proc import alive, start_time
from blocks.backoff import Poll
from blocks.checks import CheckRow, Probe, executable, writable_dir
from blocks.home import gpuferry_home
from blocks.errors import ConfigurationError, GpuferryError, JobFailed, TransientError, explain_exit_code
from blocks.launch import launch_command
from blocks.mlflow_model import ModelInfo, check_mlflow_model
from blocks.docker_spec import SECRET_ENV_NAME, with_env_file
from blocks.secrets import job_secret_values, write_secret_env
from blocks.specs import CheckpointRef, JobHandle, JobResult, JobStatus, TrainingJob
from blocks.storage import CheckpointStore
from blocks.watchdog import Watchdog
from runtime import contract

# What a local job inherits from this process's environment: enough to find programs and write files,
# nothing that authenticates (Prefect's API key, cloud credentials stay here).
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "SHELL")


def inherited_environment(names: Iterable[str] = ()) -> dict[str, str]:
    """The ``INHERITED_ENV`` variables of this process, and ``names``, that are set: all that a job, server or
    command started from here sees of the orchestrator's environment."""
    return {name: os.environ[name] for name in (*INHERITED_ENV, *names) if name in os.environ}


def run_logger(fallback: str = "gpuferry.compute") -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run, else a plain logger."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)


class ComputeBackend(Block, ABC):
    """Where training jobs run."""

    _block_type_name = "gpuferry Compute Backend"
    # The scheduler ends a job that runs past its time limit itself (the watcher then does not).
    enforces_time_limit: ClassVar[bool] = False

    workdir_root: str | None = Field(
        None, description="Directory under which each job gets its own (None: $GPUFERRY_HOME/jobs)."
    )
    poll_interval_start: float = Field(0.25, gt=0, description="First wait between two polls, in seconds.")
    poll_interval_max: float = Field(10.0, gt=0, description="Longest wait between two polls, in seconds.")
    outage_tolerance_seconds: float = Field(
        600.0, ge=0, description="How long watch() keeps polling through an outage of the backend (a controller "
        "restart, a dropped connection: the jobs keep running) before it gives up with a transient error.",
    )
    lost_job_grace_seconds: float = Field(
        600.0, ge=0, description="How long a job the backend has no record of at all (not queued, not running, not "
        "in its accounting: the scheduler lost its state, or the job's record was purged) is waited for before the "
        "run fails it as lost. It covers the accounting database catching up with a job that just left the queue.",
    )

    @property
    def backend_name(self) -> str:
        return self.get_block_type_slug()

    def job_workdir(self, key: str) -> str:
        """The directory job ``key`` owns (checkpoints, progress, log); on a cluster, a shared path."""
        root = Path(self.workdir_root) if self.workdir_root else gpuferry_home() / "jobs"
        return str(root / key)

    @abstractmethod
    def validate_job(self, job: TrainingJob) -> None:
        """Raise ``ConfigurationError`` when this backend cannot run the job as asked (no side effect)."""

    @abstractmethod
    def submit(self, job: TrainingJob) -> JobHandle:
        """Start the job, or adopt the one that already has ``job.key``."""

    @abstractmethod
    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        """Current state of every job, in one query."""

    @abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job; it is not requeued."""

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """New output of the job since ``offset``, and the next offset."""
        path = Path(handle.log_path)
        if not path.exists():
            return "", offset
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        return data.decode("utf-8", "replace"), offset + len(data)

    def read_progress(self, handle: JobHandle) -> dict[str, Any] | None:
        try:
            return json.loads((Path(handle.workdir) / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def log_tail(self, handle: JobHandle, lines: int = 30) -> str:
        text, _ = self.read_log(handle, max(0, _size(handle.log_path) - 64_000))
        return "\n".join(text.splitlines()[-lines:])

    def watch(
        self,
        handle: JobHandle,
        *,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        on_output: Callable[[str], None] | None = None,
        timeout_seconds: float | None = None,
    ) -> JobStatus:
        """Poll until the job is terminal; stream its output and progress meanwhile.

        The interval starts at ``poll_interval_start`` and grows by half each poll up to
        ``poll_interval_max``: short jobs are seen finishing at once, long ones cost little.
        A ``TransientError`` while polling (the backend is briefly unreachable; the job goes on) is
        logged and polling continues, for up to ``outage_tolerance_seconds`` in a row; then it is raised.
        ``timeout_seconds`` bounds the time one attempt runs (see the module's docstring): a job that
        waits in the queue, or is requeued, is not cancelled for it. A job the backend has lost fails after
        ``lost_job_grace_seconds`` (``blocks/watchdog.py``).
        """
        poll = Poll(self.poll_interval_start, self.poll_interval_max)
        watchdog = Watchdog(self, handle, timeout_seconds)
        offset = 0
        last_progress: dict[str, Any] | None = None
        outage_since: float | None = None
        while True:
            try:
                status = self.poll([handle])[handle.job_id]
                if on_output is not None:
                    text, offset = self.read_log(handle, offset)
                    if text:
                        on_output(text)
                progress = self.read_progress(handle)
            except TransientError as exc:
                now = time.monotonic()
                outage_since = outage_since or now
                if now - outage_since > self.outage_tolerance_seconds:
                    raise TransientError(
                        f"job {handle.job_id}: the {self.backend_name} backend did not answer for "
                        f"{now - outage_since:.0f} s (outage_tolerance_seconds={self.outage_tolerance_seconds:.0f}); "
                        f"last error: {exc}"
                    ) from exc
                run_logger().warning("job %s: cannot poll (%s); still trying", handle.job_id, exc)
                poll.wait()
                continue
            if outage_since is not None:
                run_logger().info("job %s: the backend answers again after %.0f s", handle.job_id,
                                  time.monotonic() - outage_since)  # fmt: skip
                outage_since = None
            if on_progress is not None and progress and progress != last_progress:
                on_progress(progress)
                last_progress = progress
            if status.terminal:
                return status
            failure = watchdog.check(status)
            if failure is not None:
                raise failure
            poll.wait()

    def lost_job(self, handle: JobHandle, unseen_seconds: float) -> JobFailed:
        """The failure of a job the backend has had no record of for ``unseen_seconds``. It is cancelled as far as
        the backend still can (its secret files go), in case it shows up again."""
        try:
            self.cancel(handle)
        except GpuferryError as exc:
            run_logger().warning("job %s: cancelling the lost job failed: %s", handle.job_id, exc)
        return JobFailed(
            f"job {handle.job_id} is lost: the {self.backend_name} backend has had no record of it for "
            f"{unseen_seconds:.0f} s (lost_job_grace_seconds={self.lost_job_grace_seconds:.0f}), neither queued, "
            f"running nor finished. {self.lost_job_hint(handle)} Then run it again: the job is submitted afresh.",
            state="FAILED",
        )

    def lost_job_hint(self, handle: JobHandle) -> str:
        """What to check when the backend lost job ``handle``."""
        return f"Check the backend's own records of it (its workdir {handle.workdir})."

    def result(self, handle: JobHandle, status: JobStatus, *, gpus: int = 0, cpus: int = 1) -> JobResult:
        """Turn a terminal status into a result, or raise an actionable ``JobFailed``."""
        if status.state != "COMPLETED":
            raise JobFailed(
                f"training job {handle.job_id} ended {status.state}: {status.reason or explain_exit_code(status.exit_code)}",
                state=status.state,
                exit_code=status.exit_code,
                log_tail=self.log_tail(handle),
            )
        hours = status.elapsed_seconds / 3600
        return JobResult(
            handle=handle,
            status=status,
            checkpoint_dir=str(Path(handle.workdir) / "checkpoints"),
            requeues=self._requeues(handle),
            wall_seconds=status.elapsed_seconds,
            gpu_hours=hours * gpus,
            cpu_hours=hours * cpus,
        )

    def _requeues(self, handle: JobHandle) -> int:
        return 0

    # ---- the trained model, where the job wrote it --------------------------------------------------

    def inspect_model(self, final_dir: str) -> ModelInfo:
        """The MLflow model the job wrote to ``final_dir`` (``NoModel`` when there is none)."""
        return check_mlflow_model(final_dir)

    def store_model(self, final_dir: str, store: CheckpointStore, name: str) -> CheckpointRef:
        """Store the model in ``final_dir`` as checkpoint ``name`` of ``store``. Here: from this machine's
        filesystem, which the job wrote to; a backend whose jobs write elsewhere stores from there."""
        return store.put(Path(final_dir), name)

    def check_store(self, store: CheckpointStore) -> None:
        """``ConfigurationError`` when models written by this backend's jobs cannot reach ``store`` (no side effect)."""

    def check_tracking(self, tracking_uri: str) -> None:
        """``ConfigurationError`` when this backend's jobs cannot log to ``tracking_uri`` (no side effect)."""

    # ---- job arrays: a sweep runs one task per configuration; a backend without them says so ----------

    # Whether this backend runs job arrays (the methods below); a sweep needs them.
    supports_arrays: ClassVar[bool] = False

    def no_arrays(self) -> ConfigurationError:
        return ConfigurationError(
            f"the stack's compute backend ({self.backend_name}) has no job arrays, which a sweep needs: use a "
            "stack whose compute is a Slurm cluster, or train one configuration at a time with `retrain`"
        )

    def submit_held_sweep(self, job: TrainingJob, size: int, *, parallelism: int | None = None) -> JobHandle:
        """Queue ``job`` as a held array of ``size`` tasks (idempotent by ``job.key``)."""
        raise self.no_arrays()

    def release_sweep_tasks(self, handle: JobHandle, tasks: Mapping[int, Mapping[str, str]], *,
                            whole_array: bool = False) -> None:  # fmt: skip
        """Give these held tasks (index -> its environment) their settings and let them run."""
        raise self.no_arrays()

    def array_outcome(self, handle: JobHandle, size: int) -> dict[int, tuple[JobStatus, dict[str, float]]]:
        """Each task's final state and usage (gpu_hours, cpu_hours, wall_seconds, requeues) once the array ended."""
        raise self.no_arrays()

    def task_dir(self, workdir: str, index: int) -> str:
        """The directory array task ``index`` owns (its checkpoints and progress)."""
        return posixpath.join(workdir, f"task-{index}")

    def find_job(self, key: str) -> str | None:
        """The id of a job (or array) carrying ``key``, or None."""
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def job_environment(job: TrainingJob, workdir: Path) -> dict[str, str]:
    """The contract's variables for a job whose files live in ``workdir`` (secrets not included)."""
    return {
        **job.env,
        contract.CHECKPOINT_DIR: str(workdir / "checkpoints"),
        contract.PROGRESS_FILE: str(workdir / "progress.json"),
    }


class LocalProcesses(ComputeBackend):
    """Runs the training job as processes on this machine (torchrun standalone for several).

    The embedded default: no cluster needed. Each job gets a directory under ``workdir_root``
    holding its checkpoints, progress and log, and a supervisor process that records its exit
    code, so a job outlives the flow run that started it. Its secrets (``job_secret_values``) are in a
    0600 file there that the job's shell exports (as in a container): never in its argv, in this
    process's environment or in its record; the file goes when the job ends.
    """

    _block_type_name = "gpuferry Local Processes"
    _description = "Runs training jobs as local processes (torchrun standalone when more than one)."

    python: str = Field(
        default_factory=lambda: sys.executable,
        description="Interpreter that runs a leading `python` of the workload's command (unless the workload's "
        "environment.python names one).",
    )
    threads_per_process: int | None = Field(
        None, ge=1, description="OMP/torch threads per process (None: the cores divided among the processes)."
    )
    poll_interval_max: float = Field(2.0, gt=0, description="Longest wait between two polls, in seconds.")

    _RUNNING_STATES: ClassVar[frozenset[str]] = frozenset({"PENDING", "RUNNING", "REQUEUED"})

    def validate_job(self, job: TrainingJob) -> None:
        res = job.resources
        if res.gpu_devices:
            raise ConfigurationError(
                f"resources.gpu_devices={res.gpu_devices}: local processes get the first gpus_per_node GPUs; use a "
                "Docker stack to name GPUs by index or UUID"
            )
        if res.nodes != 1:
            raise ConfigurationError(
                f"resources.nodes={res.nodes}: the local-process backend runs on this one machine; "
                "set nodes=1, or run on a Slurm stack for multi-node jobs"
            )
        if res.gpus_per_node and res.gpus_per_node < res.processes_per_node:
            raise ConfigurationError(
                f"resources.processes_per_node={res.processes_per_node} exceeds gpus_per_node="
                f"{res.gpus_per_node}: use one process per GPU"
            )
        if job.code is None or not Path(job.code.root).is_dir():
            raise ConfigurationError(
                "the job has no workload directory on this machine (job.code): local processes run the workload's "
                "command from it"
            )
        launch_command(job.command, job.python or self.python, res.processes_per_node)

    def command(self, job: TrainingJob) -> list[str]:
        return launch_command(job.command, job.python or self.python, job.resources.processes_per_node)

    def submit(self, job: TrainingJob) -> JobHandle:
        self.validate_job(job)
        workdir = Path(job.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        state = self._state(workdir)
        if state is not None:
            if state["key"] != job.key:
                raise ConfigurationError(
                    f"{workdir} already holds job {state['key']!r}; give job {job.key!r} its own workdir"
                )
            return self._handle(workdir, state)  # adopt: never a second job for one key
        state = {"key": job.key, "attempt": 0, "max_requeues": job.resources.max_requeues, "cancelled": False}
        secrets = job_secret_values(job)
        if secrets:  # kept for the job's requeues (its record holds no secret), removed when it ends
            write_secret_env(workdir / SECRET_ENV_NAME, secrets)
        state.update(self._start(job, workdir))
        state["job"] = job.model_dump(mode="json")
        self._write_state(workdir, state)
        return self._handle(workdir, state)

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        out = {}
        for handle in handles:
            out[handle.job_id] = status = self._status(Path(handle.workdir), handle.job_id)
            if status.terminal:  # no attempt reads its secrets again
                (Path(handle.workdir) / SECRET_ENV_NAME).unlink(missing_ok=True)
        return out

    def cancel(self, handle: JobHandle) -> None:
        workdir = Path(handle.workdir)
        state = self._state(workdir)
        if state is None:
            return
        state["cancelled"] = True
        self._write_state(workdir, state)
        if alive(state["pid"], state["pid_start"]):
            os.kill(state["pid"], signal.SIGTERM)

    def _requeues(self, handle: JobHandle) -> int:
        state = self._state(Path(handle.workdir))
        return 0 if state is None else int(state["attempt"])

    # ---- internals ----

    def _start(self, job: TrainingJob, workdir: Path) -> dict[str, Any]:
        res = job.resources
        assert job.code is not None  # validate_job
        env = inherited_environment()
        env.update(job_environment(job, workdir))
        threads = self.threads_per_process or max(1, (os.cpu_count() or 1) // res.processes_per_node)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("PYTHONUNBUFFERED", "1")
        if res.gpus_per_node:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(res.gpus_per_node))
        # The supervisor is a plain script (the standard library only): the job's environment needs nothing of ours.
        command = self.command(job)
        secret_file = workdir / SECRET_ENV_NAME
        if secret_file.exists():  # the job's shell exports the secrets: no value on a command line or in our env
            command = list(with_env_file(command, str(secret_file)))
        argv = [sys.executable, _job_runner.__file__, str(workdir), "--", *command]
        proc = subprocess.Popen(
            argv, cwd=job.code.root, env=env, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return {"pid": proc.pid, "pid_start": start_time(proc.pid), "submitted": time.time()}

    def _status(self, workdir: Path, job_id: str) -> JobStatus:
        state = self._state(workdir)
        if state is None:
            return JobStatus(job_id=job_id, state="FAILED", reason=f"no job state in {workdir}")
        elapsed = time.time() - state["submitted"]
        exit_path = workdir / "exit.json"
        if exit_path.exists():
            code = json.loads(exit_path.read_text())["exit_code"]
            if code == contract.EXIT_OK:
                return JobStatus(job_id=job_id, state="COMPLETED", exit_code=code, elapsed_seconds=elapsed)
            if state["cancelled"]:
                return JobStatus(job_id=job_id, state="CANCELLED", exit_code=code, elapsed_seconds=elapsed,
                                 reason="cancelled on request")  # fmt: skip
            preempted = code == contract.EXIT_PREEMPTED or (
                code != contract.EXIT_OK and (workdir / "checkpoints" / contract.PREEMPTED_MARKER).exists()
            )
            if preempted and state["attempt"] < state["max_requeues"]:
                self._requeue(workdir, state)
                return JobStatus(job_id=job_id, state="REQUEUED", exit_code=code, elapsed_seconds=elapsed,
                                 reason=f"preempted; requeued (attempt {state['attempt']})")  # fmt: skip
            reason = explain_exit_code(code)
            name = "OUT_OF_MEMORY" if code in (137, -9) else "FAILED"
            return JobStatus(job_id=job_id, state=name, exit_code=code, elapsed_seconds=elapsed, reason=reason)
        if alive(state["pid"], state["pid_start"]):
            return JobStatus(job_id=job_id, state="RUNNING", elapsed_seconds=elapsed)
        # The supervisor is gone without recording an exit: the machine's equivalent of NODE_FAIL.
        if exit_path.exists():  # it may have finished between the two checks
            return self._status(workdir, job_id)
        return JobStatus(
            job_id=job_id, state="FAILED", elapsed_seconds=elapsed,
            reason="the job's supervisor process died without recording an exit code",
        )  # fmt: skip

    def _requeue(self, workdir: Path, state: dict[str, Any]) -> None:
        state["attempt"] += 1
        os.replace(workdir / "exit.json", workdir / f"exit.{state['attempt']}.json")
        state.update(self._start(TrainingJob.model_validate(state["job"]), workdir))
        self._write_state(workdir, state)

    def _handle(self, workdir: Path, state: dict[str, Any]) -> JobHandle:
        return JobHandle(
            backend=self.backend_name, job_id=f"local-{state['key']}", key=state["key"],
            workdir=str(workdir), log_path=str(workdir / "job.log"),
        )  # fmt: skip

    @staticmethod
    def _state(workdir: Path) -> dict[str, Any] | None:
        try:
            return json.loads((workdir / "job.json").read_text())
        except FileNotFoundError:
            return None

    @staticmethod
    def _write_state(workdir: Path, state: dict[str, Any]) -> None:
        tmp = workdir / "job.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, workdir / "job.json")

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The interpreter and the jobs' directory; a stack that builds an image cannot train here."""
        if probe.needs_image:
            probe.add("image", "failed", "local processes do not run container images",
                      "use CurrentEnvironment as the stack's images, or a compute backend that runs images (Slurm)")
        probe.step("python", lambda: executable(self.python), "set python to an interpreter on this machine")
        probe.step("jobs' directory", lambda: writable_dir(self.workdir_root or str(gpuferry_home() / "jobs")),
                   "set workdir_root to a writable directory")
        return probe.rows
