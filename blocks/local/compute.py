"""Train on this machine: ``LocalProcesses``, the embedded default compute backend.

Each job is a process (several under torchrun standalone) started through a supervisor
(``blocks/local/job_runner.py``) that records its exit code, so a job outlives the flow run that started it,
as on a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from blocks.base.arrays import PolledArrays, array_handles, is_array
from blocks.base.compute import ComputeBackend, inherited_environment, job_environment
from blocks.base.launch import launch_command
from blocks.base.proc import alive, start_time
from blocks.base.secrets import SECRET_ENV_NAME, job_secret_values, with_env_file, write_secret_env
from blocks.checks import CheckRow, Probe, executable, writable_dir
from blocks.errors import ConfigurationError, explain_exit_code
from blocks.home import gpuferry_home
from blocks.local import job_runner as _job_runner
from blocks.records import JobHandle, JobStatus, TrainingJob
from runtime import contract


class LocalProcesses(PolledArrays, ComputeBackend):
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
    # Sweeps run as job arrays of local processes (blocks/base/arrays.py), as many at once as the machine has room for.

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
        arrays, jobs = array_handles(handles)
        out = {handle.job_id: self._array_status(handle) for handle in arrays}
        for handle in jobs:
            out[handle.job_id] = status = self._status(Path(handle.workdir), handle.job_id)
            if status.terminal:  # no attempt reads its secrets again
                (Path(handle.workdir) / SECRET_ENV_NAME).unlink(missing_ok=True)
        return out

    def cancel(self, handle: JobHandle) -> None:
        if is_array(handle):
            self._cancel_array(handle)
            return
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
        if res.gpus_per_node:  # a sweep's task has its own GPUs in its env (_task_env)
            env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(res.gpus_per_node)))
        # The supervisor is a plain script (the standard library only): the job's environment needs nothing of ours.
        command = self.command(job)
        secret_file = workdir / SECRET_ENV_NAME
        if secret_file.exists():  # the job's shell exports the secrets: no value on a command line or in our env
            command = list(with_env_file(command, str(secret_file)))
        argv = [sys.executable, _job_runner.__file__, str(workdir), "--", *command]
        proc = subprocess.Popen(
            argv,
            cwd=job.code.root,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
                return JobStatus(
                    job_id=job_id,
                    state="CANCELLED",
                    exit_code=code,
                    elapsed_seconds=elapsed,
                    reason="cancelled on request",
                )
            preempted = code == contract.EXIT_PREEMPTED or (
                code != contract.EXIT_OK and (workdir / "checkpoints" / contract.PREEMPTED_MARKER).exists()
            )
            if preempted and state["attempt"] < state["max_requeues"]:
                self._requeue(workdir, state)
                return JobStatus(
                    job_id=job_id,
                    state="REQUEUED",
                    exit_code=code,
                    elapsed_seconds=elapsed,
                    reason=f"preempted; requeued (attempt {state['attempt']})",
                )
            reason = explain_exit_code(code)
            name = "OUT_OF_MEMORY" if code in (137, -9) else "FAILED"
            return JobStatus(job_id=job_id, state=name, exit_code=code, elapsed_seconds=elapsed, reason=reason)
        if alive(state["pid"], state["pid_start"]):
            return JobStatus(job_id=job_id, state="RUNNING", elapsed_seconds=elapsed)
        # The supervisor is gone without recording an exit: the machine's equivalent of NODE_FAIL.
        if exit_path.exists():  # it may have finished between the two checks
            return self._status(workdir, job_id)
        return JobStatus(
            job_id=job_id,
            state="FAILED",
            elapsed_seconds=elapsed,
            reason="the job's supervisor process died without recording an exit code",
        )

    def _requeue(self, workdir: Path, state: dict[str, Any]) -> None:
        state["attempt"] += 1
        os.replace(workdir / "exit.json", workdir / f"exit.{state['attempt']}.json")
        state.update(self._start(TrainingJob.model_validate(state["job"]), workdir))
        self._write_state(workdir, state)

    def _handle(self, workdir: Path, state: dict[str, Any]) -> JobHandle:
        return JobHandle(
            backend=self.backend_name,
            job_id=f"local-{state['key']}",
            key=state["key"],
            workdir=str(workdir),
            log_path=str(workdir / "job.log"),
        )

    # ---- what a sweep's tasks need of the machine (blocks/base/arrays.py) ----

    def _room(self, job: TrainingJob) -> int:
        """How many tasks the machine has room for at once: its GPUs, or its cores, per task."""
        res = job.resources
        if res.gpus_per_node:
            from blocks.local.provider import LocalMachine

            return max(1, len(LocalMachine()._gpus()) // res.gpus_per_node)
        return max(1, (os.cpu_count() or 1) // (res.cpus_per_task * res.processes_per_node))

    def _task_env(self, job: TrainingJob, slot: int) -> dict[str, str]:
        """Task slot ``s`` gets GPUs ``s*g`` to ``s*g+g-1`` (``g``: the job's gpus_per_node)."""
        gpus = job.resources.gpus_per_node
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(slot * gpus + g) for g in range(gpus))} if gpus else {}

    def _task_requeues(self, task: Path) -> int:
        return int((self._state(task) or {}).get("attempt", 0))

    def _job_ended(self, workdir: Path) -> bool | None:
        if self._state(workdir) is None:
            return None
        return self._status(workdir, workdir.name).terminal

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
            probe.add(
                "image",
                "failed",
                "local processes do not run container images",
                "use CurrentEnvironment as the stack's images, or a compute backend that runs images (Slurm)",
            )
        probe.step("python", lambda: executable(self.python), "set python to an interpreter on this machine")
        probe.step(
            "jobs' directory",
            lambda: writable_dir(self.workdir_root or str(gpuferry_home() / "jobs")),
            "set workdir_root to a writable directory",
        )
        return probe.rows
