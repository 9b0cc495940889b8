"""A submitted Slurm job's life: its log and progress, its state (one batched squeue per poll, sacct for what
the controller forgot), cancelling it, its secret files removed once it cannot start again, and its usage.

``SlurmJobs`` is a mixin of ``SlurmCluster``: it uses the block's commands and files (``run``, ``_read``,
``_size``, ``_raise_for``: ``blocks/slurm/transport.py``) and keeps the last squeue answer in the private
``_last_jobs`` (``array_outcome`` of ``blocks/slurm/arrays.py`` reuses it). What the commands answer is read
by the pure functions of ``blocks/slurm/state.py``.

* ``poll(handles)`` is ONE ``squeue -j <every watched job>`` (text fields: ``squeue --json`` in 22.05 ignores
  ``-j`` and serialises every job the controller holds), plus one ``sacct`` for jobs that left the
  controller's memory.
* ``result()`` adds GPU-hours (allocated ``gres/gpu`` × elapsed, every attempt of a requeued job) and
  CPU-hours from ``sacct``.
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from blocks.base.backoff import Poll
from blocks.base.log import run_logger
from blocks.errors import JobFailed, TransientError, explain_exit_code
from blocks.records import JobHandle, JobResult, JobStatus
from blocks.slurm.containers import ENROOT_CREDENTIALS_NAME, REGISTRY_AUTH_NAME
from blocks.slurm.state import (
    SACCT_STATUS_FORMAT,
    SACCT_USAGE_FORMAT,
    accounting_settled,
    parse_squeue,
    squeue_argv,
    statuses_from_sacct,
    statuses_from_squeue,
    usage,
    usage_rows,
)
from blocks.slurm.submit import SECRETS_NAME

# The files a job reads its secrets and registry login from: needed while it may still (re)start.
SECRET_FILES = (SECRETS_NAME, REGISTRY_AUTH_NAME, ENROOT_CREDENTIALS_NAME)


if TYPE_CHECKING:
    from blocks.slurm.host import SlurmHost
else:
    SlurmHost = object  # the type checker's view of the block (blocks/slurm/host.py); a plain mixin here


class SlurmJobs(SlurmHost):
    """The watching side of a ``SlurmCluster`` (see the module's docstring)."""

    # ---- the job's files ---------------------------------------------------------------------

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        data = self._read(handle.log_path, offset)
        if not data:
            return "", offset
        return data.decode("utf-8", "replace"), offset + len(data)

    def read_progress(self, handle: JobHandle) -> dict[str, Any] | None:
        data = self._read(posixpath.join(handle.workdir, "progress.json"))
        try:
            return json.loads(data) if data else None
        except json.JSONDecodeError:
            return None  # caught mid-write by a job that does not write atomically

    def log_tail(self, handle: JobHandle, lines: int = 30) -> str:
        path = handle.log_path
        if "%a" in path:  # an array: the log of its first failed (or first) task
            path = path.replace("%a", str(self._first_failed_task(handle) or 0))
        size = self._size(path)
        data = self._read(path, max(0, size - 64_000), 64_000) or b""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    # ---- state -----------------------------------------------------------------------------

    def _squeue(self, job_ids: Iterable[str] = ()) -> list[dict[str, Any]]:
        """The controller's records of ``job_ids`` (of every job it holds when none are given): ONE squeue
        (``blocks/slurm/state.py``); the last answer is kept for ``array_outcome``."""
        ids = {str(j) for j in job_ids}
        argv = squeue_argv(ids)
        rc, out, err = self.run(argv, check=False)
        if rc != 0:
            # squeue looks a single id up on its own, and one the controller has forgotten is an error.
            if not (len(ids) == 1 and "Invalid job id" in err):
                self._raise_for(argv, rc, err or out)
            out = ""
        jobs = parse_squeue(out)
        self._last_jobs = (time.monotonic(), jobs)
        return jobs

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        handles = list(handles)
        if not handles:
            return {}
        wanted = {h.job_id for h in handles}
        statuses = statuses_from_squeue(self._squeue(wanted), wanted)  # ONE query for every watched job
        missing = [j for j in wanted if j not in statuses]
        if missing:
            statuses.update(self._from_sacct(missing))
        return {h.job_id: statuses[h.job_id] for h in handles}

    def _from_sacct(self, job_ids: list[str]) -> dict[str, JobStatus]:
        _, out, _ = self.run(
            ["sacct", "-X", "-n", "-P", "-j", ",".join(sorted(job_ids, key=int)), f"--format={SACCT_STATUS_FORMAT}"]
        )
        return statuses_from_sacct(out, job_ids)

    def _first_failed_task(self, handle: JobHandle) -> str | None:
        status = self.poll([handle])[handle.job_id]
        for word in status.reason.split():
            if word.startswith(f"{handle.job_id}_"):
                return word.split("_", 1)[1].rstrip(":")
        return None

    def cancel(self, handle: JobHandle) -> None:
        self.run(["scancel", handle.job_id])
        self.remove_job_secrets(handle)

    def lost_job_hint(self, handle: JobHandle) -> str:
        return (
            f"Neither squeue nor sacct knows job {handle.job_id} ({handle.key}): the controller lost its state (a "
            "slurmctld restarted from an old or emptied StateSaveLocation, or killed before it saved the job), or "
            "its accounting record was purged (PurgeJobAfter) or never written (slurmdbd down). Check "
            f"`sacct -D -j {handle.job_id}`, slurmctld's and slurmdbd's logs, and the job's log {handle.log_path}."
        )

    def remove_job_secrets(self, handle: JobHandle) -> None:
        """Delete the job's secret and login files once it cannot start again (it ended, or was cancelled).
        Best effort: a failure is logged (the files are 0600, in the job's own directory)."""
        paths = [posixpath.join(handle.workdir, name) for name in SECRET_FILES]
        try:
            self.run(["rm", "-f", "--", *paths], check=False)
        except TransientError as exc:
            run_logger().warning("job %s: could not remove its secret files (%s): %s", handle.job_id, exc, paths)

    # ---- accounting ------------------------------------------------------------------------

    def accounting(self, handle: JobHandle, *, wait_seconds: float = 30.0) -> dict[str, float]:
        """GPU-hours, CPU-hours, wall seconds and requeues of a finished job, from sacct.

        Every attempt counts (``--duplicates``: a preempted attempt used its GPUs too). sacct lags the
        controller by a few seconds, so this waits (up to ``wait_seconds``) for the final record.
        """
        poll = Poll(0.5, 2.0, timeout=wait_seconds)
        while True:
            _, out, _ = self.run(
                ["sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id, f"--format={SACCT_USAGE_FORMAT}"]
            )
            rows = usage_rows(out)
            if accounting_settled(rows) or poll.expired():
                break
            poll.wait()
        return usage(rows)

    def result(self, handle: JobHandle, status: JobStatus, *, gpus: int = 0, cpus: int = 1) -> JobResult:
        """A terminal status as a result with sacct's GPU/CPU-hours, or an actionable ``JobFailed``. The job's
        secret files go: it will not start again."""
        self.remove_job_secrets(handle)
        if status.state != "COMPLETED":
            raise JobFailed(
                f"Slurm job {handle.job_id} ended {status.state}: "
                f"{status.reason or explain_exit_code(status.exit_code)}",
                state=status.state,
                exit_code=status.exit_code,
                log_tail=self.log_tail(handle),
            )
        used = self.accounting(handle)
        return JobResult(
            handle=handle,
            status=status,
            checkpoint_dir=posixpath.join(handle.workdir, "checkpoints"),
            requeues=int(used["requeues"]),
            wall_seconds=used["wall_seconds"] or status.elapsed_seconds,
            gpu_hours=used["gpu_hours"],
            cpu_hours=used["cpu_hours"],
        )
