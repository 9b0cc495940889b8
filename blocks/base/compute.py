"""The compute step's interface: where a training job runs.

``ComputeBackend`` is the interface every backend implements (``blocks/local/compute.py``: processes on this
machine; ``blocks/slurm/``: Slurm over SSH; ``blocks/docker/compute.py``: one Docker host):

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
  ``lost_job_grace_seconds`` (``blocks/base/watchdog.py``, whose rules the job watcher applies too);
* ``self_check(probe)``: what ``gpuferry check`` reports of it.

Preempted jobs (exit code ``EXIT_PREEMPTED`` of the contract) are requeued by the backend up to
``resources.max_requeues`` times, and resume from their last checkpoint.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from blocks.base.backoff import Poll
from blocks.base.log import run_logger
from blocks.base.mlflow_model import ModelInfo, check_mlflow_model
from blocks.base.storage import CheckpointStore
from blocks.base.watchdog import Watchdog
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, JobFailed, TransientError, explain_exit_code
from blocks.home import gpuferry_home
from blocks.records import CheckpointRef, Garbage, JobHandle, JobResult, JobStatus, TrainingJob
from runtime import contract

# What a local job inherits from this process's environment: enough to find programs and write files,
# nothing that authenticates (Prefect's API key, cloud credentials stay here).
INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "SHELL")


def inherited_environment(names: Iterable[str] = ()) -> dict[str, str]:
    """The ``INHERITED_ENV`` variables of this process, and ``names``, that are set: all that a job, server or
    command started from here sees of the orchestrator's environment."""
    return {name: os.environ[name] for name in (*INHERITED_ENV, *names) if name in os.environ}


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
        600.0,
        ge=0,
        description="How long watch() keeps polling through an outage of the backend (a controller "
        "restart, a dropped connection: the jobs keep running) before it gives up with a transient error.",
    )
    lost_job_grace_seconds: float = Field(
        600.0,
        ge=0,
        description="How long a job the backend has no record of at all (not queued, not running, not "
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
    def self_check(self, probe: Probe) -> list[CheckRow]:
        """What ``gpuferry check`` reports of this backend: each check a row of ``probe`` (``blocks/checks.py``). It
        only reads, or writes a probe object and deletes it; ``Stack.check`` runs it with a deadline."""

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
        on_state: Callable[[JobStatus], None] | None = None,
        timeout_seconds: float | None = None,
    ) -> JobStatus:
        """Poll until the job is terminal; stream its output and progress meanwhile.

        The interval starts at ``poll_interval_start`` and grows by half each poll up to
        ``poll_interval_max``: short jobs are seen finishing at once, long ones cost little.
        A ``TransientError`` while polling (the backend is briefly unreachable; the job goes on) is
        logged and polling continues, for up to ``outage_tolerance_seconds`` in a row; then it is raised.
        ``timeout_seconds`` bounds the time one attempt runs (see the module's docstring): a job that
        waits in the queue, or is requeued, is not cancelled for it. A job the backend has lost fails after
        ``lost_job_grace_seconds`` (``blocks/base/watchdog.py``). ``on_state`` hears each new state of the job
        (PENDING with the scheduler's reason, RUNNING with its nodes, requeued...): once per change of state,
        reason or nodes, not once per poll.
        """
        poll = Poll(self.poll_interval_start, self.poll_interval_max)
        watchdog = Watchdog(self, handle, timeout_seconds)
        offset = 0
        last_progress: dict[str, Any] | None = None
        last_state: tuple[str, str, str] | None = None
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
                run_logger().info(
                    "job %s: the backend answers again after %.0f s", handle.job_id, time.monotonic() - outage_since
                )
                outage_since = None
            seen = (status.state, status.reason, status.nodes)
            if on_state is not None and seen != last_state and status.visible:
                on_state(status)
                last_state = seen
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
                f"training job {handle.job_id} ended {status.state}: "
                f"{status.reason or explain_exit_code(status.exit_code)}",
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
            "stack whose compute runs job arrays (SlurmCluster, LocalProcesses, DockerCompute), or train one "
            "configuration at a time with `retrain`"
        )

    def submit_held_sweep(self, job: TrainingJob, size: int, *, parallelism: int | None = None) -> JobHandle:
        """Queue ``job`` as a held array of ``size`` tasks (idempotent by ``job.key``)."""
        raise self.no_arrays()

    def release_sweep_tasks(
        self, handle: JobHandle, tasks: Mapping[int, Mapping[str, str]], *, whole_array: bool = False
    ) -> None:
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

    # ---- housekeeping (``gpuferry gc``) ----

    def ended_jobs(self) -> list[Garbage]:
        """The directories of this backend's jobs that ended, with their size and last write: what ``gpuferry gc``
        may free (a backend that ships code may list its code directories too). None listed here: a backend that can
        tell says (``blocks/base/arrays.py``, ``blocks/slurm/housekeeping.py``)."""
        return []

    def remove_job(self, where: str) -> None:
        """Delete the directory of a job that ended (one ``ended_jobs`` listed)."""
        raise ConfigurationError(f"the {self.backend_name} backend does not remove job directories")


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
