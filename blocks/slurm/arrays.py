"""Sweeps on Slurm: one job array, one environment per task, released in parts as its settings are made.

``SlurmArrays`` is a mixin of ``SlurmCluster`` (``supports_arrays``): the array is submitted held, each
task's settings go next to the script as ``tasks/<index>.env`` (which the script's task exports) and
``scontrol release`` lets those tasks run, in one command however many tasks; at the end one ``squeue``
(and ``sacct`` for what the controller forgot) gives each task's final state and usage.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from blocks.base.backoff import Poll
from blocks.errors import ConfigurationError
from blocks.records import JobHandle, JobStatus, TrainingJob
from blocks.slurm.state import (
    SACCT_TASK_FORMAT,
    array_task_rows,
    index_ranges,
    release_problems,
    status_from_squeue,
    task_status,
    usage,
    usage_row_from_squeue,
)
from runtime import contract

TASKS_DIR = "tasks"
MAX_ARRAY_TASKS = 1_000_000  # Slurm's own bound; a cluster's MaxArraySize is lower (sbatch then says so)


if TYPE_CHECKING:
    from blocks.slurm.host import SlurmHost
else:
    SlurmHost = object  # the type checker's view of the block (blocks/slurm/host.py); a plain mixin here


class SlurmArrays(SlurmHost):
    """Job arrays of a ``SlurmCluster`` (see the module's docstring)."""

    # Mixed into SlurmCluster, whose commands (run, _put_files: slurm_ssh.py), submit path (validate_job,
    # _script_for_job; ship_code, _submit: slurm_submit.py) and job state (_squeue, _last_jobs,
    # remove_job_secrets: slurm_jobs.py) it uses.

    @staticmethod
    def task_dir(workdir: str, index: int) -> str:
        """The directory array task ``index`` of a sweep owns (its checkpoints and progress)."""
        return posixpath.join(workdir, f"task-{index}")

    def submit_sweep(
        self, job: TrainingJob, tasks: Sequence[Mapping[str, str]], *, parallelism: int | None = None
    ) -> JobHandle:
        """Run ``job`` once per entry of ``tasks`` as ONE job array (task ``i`` gets ``tasks[i]`` on
        top of ``job.env``, and its own checkpoint directory and progress file under ``task_dir``).

        Idempotent by ``job.key`` like ``submit``. ``parallelism`` throttles how many tasks run at once
        (``--array=0-N%P``). The same as ``submit_held_sweep`` then ``release_sweep_tasks`` of all tasks,
        the array released whole.
        """
        if not tasks:
            raise ConfigurationError("a sweep needs at least one task")
        settings = dict(enumerate(tasks))
        self._task_entries(job.workdir, settings)  # every setting checked before anything is submitted
        handle = self.submit_held_sweep(job, len(tasks), parallelism=parallelism)
        self.release_sweep_tasks(handle, settings, whole_array=True)
        return handle

    def submit_held_sweep(self, job: TrainingJob, size: int, *, parallelism: int | None = None) -> JobHandle:
        """Queue a job array of ``size`` tasks, held (``sbatch --hold``): a task runs once
        ``release_sweep_tasks`` has given it its settings. The array can thus be queued while the
        settings (each task's MLflow run, say) are still being made, and start in chunks as they come.

        Idempotent by ``job.key`` like ``submit``: a retry adopts the array, whose released tasks go on.
        """
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_ARRAY_TASKS:
            raise ConfigurationError(f"a sweep has 1 to {MAX_ARRAY_TASKS} tasks, not {size!r}")
        self.validate_job(job)
        self.ship_code(job)
        script = self._script_for_job(job, array_size=size, parallelism=parallelism)
        return self._submit(
            job.key,
            job.workdir,
            script,
            array=True,
            hold=True,
            secret_env=self._secret_env(job),
            secret_files=self._container_files(job),
        )

    def release_sweep_tasks(
        self, handle: JobHandle, tasks: Mapping[int, Mapping[str, str]], *, whole_array: bool = False
    ) -> None:
        """Give these tasks of a held array (index -> its environment) their settings and let them run.

        One command, however many tasks: the settings go next to the script as ``tasks/<index>.env``
        (NUL-separated NAME=value words, which task ``SLURM_ARRAY_TASK_ID`` exports without starting
        any program), then ``scontrol release``. A settings file already there is kept (a retry writes
        the same settings), and releasing a task that already ran is no error. The settings are not
        secrets (use secret_env for those).

        ``whole_array``: release every task of the array that is still held (each must have its
        settings by now, from this call or an earlier one) with ``scontrol release <array>``. The held
        tasks stay in the array's one job record, whereas Slurm splits each task released by its index
        into a record of its own, which it schedules apart: release the bulk of an array whole.
        """
        entries = self._task_entries(handle.workdir, tasks)
        if not entries and not whole_array:
            return
        target = handle.job_id if whole_array else f"{handle.job_id}_[{index_ranges(entries)}]"
        argv = ["scontrol", "release", target]
        files = {
            f"{TASKS_DIR}/{index}.env": ("".join(f"{name}={value}\0" for name, value in entry.items()).encode(), 0o644)
            for index, entry in entries.items()
        }
        if files:  # the settings, then the release: one command
            rc, out, err = self._put_files(handle.workdir, files, keep_existing=True, then=argv, check=False)
        else:
            rc, out, err = self.run(argv, check=False)
        problems = release_problems(err + out)
        if rc != 0 and problems:
            self._raise_for(argv, rc, "\n".join(problems))

    def _task_entries(self, workdir: str, tasks: Mapping[int, Mapping[str, str]]) -> dict[int, dict[str, str]]:
        entries = {}
        for index, task_env in sorted(tasks.items()):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_ARRAY_TASKS:
                raise ConfigurationError(f"task index {index!r} must be an integer from 0 to {MAX_ARRAY_TASKS - 1}")
            for name, value in task_env.items():
                if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
                    raise ConfigurationError(f"task {index}: environment name {name!r} is not a variable name")
                if not isinstance(value, str) or "\x00" in value:
                    raise ConfigurationError(f"task {index}: {name} must be a string without NUL bytes")
            task_dir = self.task_dir(workdir, index)
            entries[index] = {
                **task_env,
                contract.CHECKPOINT_DIR: posixpath.join(task_dir, "checkpoints"),
                contract.PROGRESS_FILE: posixpath.join(task_dir, "progress.json"),
            }
        return entries

    def array_outcome(
        self, handle: JobHandle, size: int, *, wait_seconds: float = 60.0
    ) -> dict[int, tuple[JobStatus, dict[str, float]]]:
        """The final state and the usage (``accounting``'s keys) of each of the ``size`` tasks of a
        finished array.

        One ``squeue`` (none when the poll that saw the array end, a moment ago, holds every task):
        the controller keeps finished tasks (MinJobAge) with their state, times and allocated TRES,
        which is all of it for a task that ran once. Tasks it has forgotten, and requeued ones (only
        sacct has their earlier attempts), come from ONE sacct per try, which lags the controller:
        this waits up to ``wait_seconds`` for them.
        """
        self.remove_job_secrets(handle)  # the array has ended: no task starts again
        found: dict[int, tuple[JobStatus, dict[str, float]]] = {}
        fetched, records = self._last_jobs
        ended = sum(
            1
            for r in records
            if str(r.get("array_job_id") or "") == handle.job_id
            and r.get("array_task_id") is not None
            and status_from_squeue(r).terminal
        )
        if time.monotonic() - fetched > 30 or ended < size:
            records = self._squeue([handle.job_id])
        for record in records:
            if str(record.get("array_job_id") or "") != handle.job_id or record.get("array_task_id") is None:
                continue
            status = status_from_squeue(record)
            if status.terminal and not record.get("restart_cnt"):
                found[int(record["array_task_id"])] = (status, usage([usage_row_from_squeue(record, status)]))
        rest = [i for i in range(size) if i not in found]
        poll = Poll(0.5, 2.0, timeout=wait_seconds)
        while rest:
            _, out, _ = self.run(
                ["sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id, f"--format={SACCT_TASK_FORMAT}"]
            )
            per_task = array_task_rows(out)
            for index in list(rest):
                rows = per_task.get(index, [])
                final = task_status(rows)
                if final is not None:
                    found[index] = (final, usage(rows))
                    rest.remove(index)
            if not rest or poll.expired():
                break
            poll.wait()
        missing = JobStatus(job_id=handle.job_id, state="FAILED", reason="no final state recorded for this array task")
        return {
            i: found.get(i, (missing.model_copy(update={"job_id": f"{handle.job_id}_{i}"}), usage([])))
            for i in range(size)
        }
