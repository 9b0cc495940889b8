"""Job arrays a backend runs itself, started by the flow's own polls: sweeps where no scheduler runs arrays.

``PolledArrays`` is a mixin of a compute backend whose jobs live in directories the flow's process sees
(``LocalProcesses``: this machine; ``DockerCompute``: one Docker host), with the semantics of a Slurm job array
(``blocks/slurm/arrays.py``): the array is queued held (``array.json`` in its directory records it), each task gets
its settings when ``release_sweep_tasks`` gives them, and each released task then runs as a job of the backend of
its own in ``task-<i>/`` (its checkpoints, progress, log; preempted, it is requeued like any of its jobs).

Nothing runs beside the flow to start tasks: each poll of the array (the flow's ``watch``) starts released tasks
while fewer than ``parallelism`` run. That is the sweep's own setting; by default as many as the backend has room
for (``_room``: its GPUs, ``gpus_per_node`` each, or its cores when the job asks for no GPU). Which GPUs a task
gets is the backend's: a task slot's own (``_task_env``, ``LocalProcesses``), or its allocator's
(``DockerCompute``, where a task that finds its GPUs taken waits for the next poll: ``_start_task``). A flow that
stops leaves its running tasks running; a retry adopts the array by its key and its polls start the rest.

The backend gives: ``_status(task_dir, job_id)`` (a job's status from its directory), ``_task_requeues(task_dir)``
and ``_room(job)``; it sends the arrays among the handles it polls or cancels here (``array_handles``,
``is_array``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from blocks.errors import ConfigurationError
from blocks.records import Garbage, JobHandle, JobStatus, TrainingJob

ARRAY_FILE = "array.json"


if TYPE_CHECKING:
    from blocks.base.compute import ComputeBackend

    class _Base(ComputeBackend):
        """The type checker's view of the backend: a compute backend, and the internal of its jobs the arrays read
        (each task is one of its jobs)."""

        def _status(self, workdir: Path, job_id: str) -> JobStatus:
            raise NotImplementedError

else:
    _Base = object  # a plain mixin here


class PolledArrays(_Base):
    """Job arrays run by the backend itself, each task one of its jobs (see the module's docstring)."""

    supports_arrays: ClassVar[bool] = True

    def _room(self, job: TrainingJob) -> int:
        """How many tasks of ``job`` the backend has room for at once."""
        raise NotImplementedError

    def _task_requeues(self, task: Path) -> int:
        """How often the task in directory ``task`` was requeued."""
        raise NotImplementedError

    def _task_env(self, job: TrainingJob, slot: int) -> dict[str, str]:
        """Variables of the task that runs in ``slot`` (0 .. parallelism-1) besides its settings; none here."""
        return {}

    def _start_task(self, task: TrainingJob) -> bool:
        """Submit one task; False when it cannot start yet (the next poll tries again)."""
        self.submit(task)
        return True

    def _job_ended(self, workdir: Path) -> bool | None:
        """Whether the job in ``workdir`` ended (None: ``workdir`` holds no job of this backend)."""
        raise NotImplementedError

    # ---- housekeeping: the directories of jobs and arrays that ended (``gpuferry gc``) ----

    def ended_jobs(self) -> list[Garbage]:
        root = Path(self.job_workdir("-")).parent
        out = []
        for workdir in sorted(root.iterdir()) if root.is_dir() else []:
            if not workdir.is_dir() or workdir.name.startswith("."):
                continue
            state = _read(workdir)
            ended = self._array_ended(workdir, state) if state is not None else self._job_ended(workdir)
            if ended:
                size, modified = _usage(workdir)
                out.append(Garbage(kind="job directory", where=str(workdir), size_bytes=size, modified=modified))
        return out

    def remove_job(self, where: str) -> None:
        workdir = Path(where)
        if workdir.resolve().parent != Path(self.job_workdir("-")).resolve().parent:
            raise ConfigurationError(f"{where} is not a job directory of this backend")
        shutil.rmtree(workdir, ignore_errors=True)

    def _array_ended(self, workdir: Path, state: dict[str, Any]) -> bool:
        """No task runs, and none is left to start (every task ended, or the array was cancelled)."""
        tasks = [self._task_status(workdir, state, i) for i in range(state["size"])]
        if any(t is not None and not t.terminal for t in tasks):
            return False
        return bool(state["cancelled"]) or all(t is not None for t in tasks)

    def submit_held_sweep(self, job: TrainingJob, size: int, *, parallelism: int | None = None) -> JobHandle:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"a sweep has at least one task, not {size!r}")
        self.validate_job(job)
        workdir = Path(job.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        state = _read(workdir)
        if state is not None:
            if state["key"] != job.key:
                raise ConfigurationError(f"{workdir} holds the sweep {state['key']!r}, not {job.key!r}")
            return self._array_handle(workdir, state)  # adopt: a retry never queues a second array
        slots = parallelism or self._room(job)
        state = {
            "key": job.key,
            "size": size,
            "parallelism": max(1, min(slots, size)),
            "released": {},
            "slots": {},
            "cancelled": False,
            "submitted": time.time(),
            "job": job.model_dump(mode="json"),
        }
        _write(workdir, state)
        return self._array_handle(workdir, state)

    def release_sweep_tasks(
        self, handle: JobHandle, tasks: Mapping[int, Mapping[str, str]], *, whole_array: bool = False
    ) -> None:
        workdir = Path(handle.workdir)
        state = self._array_state(workdir)
        for index, env in tasks.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < state["size"]:
                raise ConfigurationError(f"task index {index!r} is not one of the sweep's 0..{state['size'] - 1}")
            state["released"].setdefault(str(index), dict(env))  # a retry gives the same settings
        if whole_array:
            missing = [i for i in range(state["size"]) if str(i) not in state["released"]]
            if missing:
                raise ConfigurationError(f"tasks {missing[:10]} of the sweep have no settings yet")
        _write(workdir, state)
        self._schedule(workdir, state)

    def array_outcome(self, handle: JobHandle, size: int) -> dict[int, tuple[JobStatus, dict[str, float]]]:
        workdir = Path(handle.workdir)
        job = TrainingJob.model_validate(self._array_state(workdir)["job"])
        gpus, cpus = job.resources.gpus_per_node, job.resources.cpus_per_task * job.resources.processes_per_node
        out = {}
        for index in range(size):
            task = Path(self.task_dir(str(workdir), index))
            status = self._status(task, f"{handle.job_id}_{index}")
            hours = status.elapsed_seconds / 3600
            usage = {
                "gpu_hours": hours * gpus,
                "cpu_hours": hours * cpus,
                "wall_seconds": status.elapsed_seconds,
                "requeues": float(self._task_requeues(task)),
            }
            out[index] = (status, usage)
        return out

    def find_job(self, key: str) -> str | None:
        workdir = Path(self.job_workdir(key))
        state = _read(workdir)
        return self._array_handle(workdir, state).job_id if state is not None and state["key"] == key else None

    # ---- the array's state, as poll and cancel see it ----

    def _array_status(self, handle: JobHandle) -> JobStatus:
        workdir = Path(handle.workdir)
        state = self._array_state(workdir)
        self._schedule(workdir, state)
        elapsed = time.time() - state["submitted"]
        tasks = [self._task_status(workdir, state, i) for i in range(state["size"])]
        running = [t for t in tasks if t is not None and not t.terminal]
        if running or (not state["cancelled"] and any(t is None for t in tasks)):
            started = any(t is not None for t in tasks)
            reason = f"{sum(1 for t in tasks if t is not None and t.terminal)} of {len(tasks)} tasks ended"
            return JobStatus(
                job_id=handle.job_id, state="RUNNING" if started else "PENDING", elapsed_seconds=elapsed, reason=reason
            )
        if state["cancelled"]:
            return JobStatus(job_id=handle.job_id, state="CANCELLED", elapsed_seconds=elapsed, reason="cancelled")
        failed = [i for i, t in enumerate(tasks) if t is not None and t.state != "COMPLETED"]
        return JobStatus(
            job_id=handle.job_id,
            state="FAILED" if failed else "COMPLETED",
            elapsed_seconds=elapsed,
            reason=f"tasks {failed[:10]} did not complete" if failed else "",
        )

    def _cancel_array(self, handle: JobHandle) -> None:
        workdir = Path(handle.workdir)
        state = self._array_state(workdir)
        state["cancelled"] = True
        _write(workdir, state)
        for index in state["slots"]:
            self.cancel(self._task_handle(workdir, state, int(index)))

    # ---- internals ----

    def _schedule(self, workdir: Path, state: dict[str, Any]) -> None:
        """Start released tasks while fewer than ``parallelism`` run (each in a free GPU slot)."""
        if state["cancelled"]:
            return
        busy: set[int] = set()
        for index, slot in state["slots"].items():
            status = self._task_status(workdir, state, int(index))
            if status is not None and not status.terminal:
                busy.add(slot)
        job = TrainingJob.model_validate(state["job"])
        for index_text, env in sorted(state["released"].items(), key=lambda item: int(item[0])):
            if index_text in state["slots"]:
                continue
            free = next((s for s in range(state["parallelism"]) if s not in busy), None)
            if free is None:
                break
            index = int(index_text)
            task = job.model_copy(
                update={
                    "key": f"{job.key}-task-{index}",
                    "workdir": self.task_dir(str(workdir), index),
                    "env": {**job.env, **env, **self._task_env(job, free)},
                }
            )
            if not self._start_task(task):
                break
            state["slots"][index_text] = free
            busy.add(free)
            _write(workdir, state)

    def _task_status(self, workdir: Path, state: dict[str, Any], index: int) -> JobStatus | None:
        """A started task's status (None: not started yet)."""
        if str(index) not in state["slots"]:
            return None
        return self._status(Path(self.task_dir(str(workdir), index)), f"{state['key']}_{index}")

    def _task_handle(self, workdir: Path, state: dict[str, Any], index: int) -> JobHandle:
        task = Path(self.task_dir(str(workdir), index))
        return JobHandle(
            backend=self.backend_name,
            job_id=f"local-{state['key']}-task-{index}",
            key=f"{state['key']}-task-{index}",
            workdir=str(task),
            log_path=str(task / "job.log"),
        )

    def _array_handle(self, workdir: Path, state: dict[str, Any]) -> JobHandle:
        return JobHandle(
            backend=self.backend_name,
            job_id=f"local-array-{state['key']}",
            key=state["key"],
            workdir=str(workdir),
            log_path=str(workdir / "array.log"),
        )

    def _array_state(self, workdir: Path) -> dict[str, Any]:
        state = _read(workdir)
        if state is None:
            raise ConfigurationError(f"{workdir} holds no sweep ({ARRAY_FILE} is missing)")
        return state


def _usage(workdir: Path) -> tuple[int, float]:
    """(bytes, the newest mtime) of the files under ``workdir``."""
    size, newest = 0, workdir.stat().st_mtime
    for path in workdir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            info = path.stat()
            size, newest = size + info.st_size, max(newest, info.st_mtime)
    return size, newest


def is_array(handle: JobHandle) -> bool:
    return (Path(handle.workdir) / ARRAY_FILE).exists()


def _read(workdir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / ARRAY_FILE).read_text())
    except FileNotFoundError:
        return None


def _write(workdir: Path, state: dict[str, Any]) -> None:
    tmp = workdir / f"{ARRAY_FILE}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, workdir / ARRAY_FILE)


def array_handles(handles: Iterable[JobHandle]) -> tuple[list[JobHandle], list[JobHandle]]:
    """(the arrays', the jobs') handles of ``handles``."""
    handles = list(handles)
    arrays = [h for h in handles if is_array(h)]
    return arrays, [h for h in handles if not is_array(h)]
