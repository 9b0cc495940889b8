"""Train in the workload's image on one Docker host (or podman): ``DockerCompute``, a ``ComputeBackend``.

* ``submit(job)`` runs the job's argv in its image, pinned by digest, as the container
  ``gpuferry-job-<key>`` labelled with the key. It is idempotent: a container of that name, or the
  job's state in its directory, is adopted — a retried submit never starts a second one, and the
  container outlives the process that started it. GPUs are chosen before it exists (count, indices or
  UUIDs; ``blocks/docker/gpu_alloc.py``) and held in its labels (``blocks/docker/engine.py``).
* The job's directory (``workdir_root``/<key>) is bind-mounted at the same path: checkpoints, progress
  and the contract's variables are as on the other backends. ``workdir_root`` must be a path the Docker
  host and this process both see (the same machine, or a shared filesystem), as on Slurm.
* The job's variables are in the container's configuration; secrets (``train.secrets`` and
  ``pass_env``) never are: they are in a 0600 file in the job's directory that a ``sh`` in the image
  sources before it becomes the job (``blocks/docker/spec.py``).
* A job that stops with the contract's exit code 75 (``docker stop`` sends SIGTERM: it checkpoints and
  exits) is started again, up to ``resources.max_requeues`` times, and resumes from its checkpoint.
  ``cancel`` stops it for good.
* Once a job has ended, its output (with the engine's timestamps) is saved as ``job.log`` and its end as
  ``exit.json`` in its directory, and the container is removed (``keep_finished_containers``: kept).
  An OOM kill or an exit 137 ends with a message that says what to change.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field

from blocks.base.arrays import PolledArrays, array_handles, is_array
from blocks.base.compute import ComputeBackend, job_environment
from blocks.base.launch import launch_command
from blocks.base.log import run_logger
from blocks.base.secrets import SECRET_ENV_NAME, check_env_names, job_secret_values, write_secret_env
from blocks.checks import CheckRow, Probe
from blocks.docker.engine import NameInUse, offset_second, read_from, save, strip_timestamps
from blocks.docker.gpu_alloc import GpuRequest, GpusBusy, HostGpu, claim_label, parse_claim_label
from blocks.docker.gpu_host import DockerGpuHost
from blocks.docker.spec import (
    EXIT_RECORD,
    LABEL_GPU_SHARING,
    LABEL_GPUS,
    LABEL_JOB_KEY,
    LABEL_KIND,
    LABEL_WORKDIR,
    container_exit_reason,
    container_name,
    training_container,
)
from blocks.errors import ConfigurationError, explain_exit_code
from blocks.records import JobHandle, JobStatus, TrainingJob
from blocks.specs import Resources
from blocks.values import check_name, check_pinned_image
from runtime import contract

STATE_NAME = "docker-job.json"
LOCK_NAME = ".docker-job.lock"
LOG_NAME = "job.log"
_RUNNING = frozenset({"running", "paused", "restarting", "stopping"})


class DockerCompute(PolledArrays, ComputeBackend, DockerGpuHost):
    """Training jobs as containers of the workload's image on one Docker host, GPUs chosen per job."""

    _block_type_name = "gpuferry Docker Compute"
    _description = (
        "Runs training jobs in the workload's image on one Docker host (or podman): GPUs by count, index or UUID, "
        "never given to two jobs, idempotent submit by label, requeue on exit 75."
    )

    workdir_root: str | None = Field(
        None,
        description="Directory under which each job gets its own, bind-mounted at the same path: one the "
        "Docker host and the flow's process both see (the same machine or a shared filesystem). None: "
        "$GPUFERRY_HOME/jobs.",
    )
    network_mode: str | None = Field(
        "host",
        description="The job's network: host (it reaches what the host reaches, e.g. an MLflow server on "
        "127.0.0.1), a Docker network's name, or None (the engine's default bridge).",
    )
    mounts: list[str] = Field(
        default_factory=list,
        description="More host paths mounted at the same path (datasets, a file-based MLflow "
        "store); the job's directory always is.",
    )
    user: str | None = Field(None, description="uid[:gid] the job runs as (None: the image's user).")
    shm_size_mb: int | None = Field(
        2048, ge=64, description="Size of /dev/shm (PyTorch data-loader workers share batches through it)."
    )
    stop_timeout_seconds: int = Field(
        60,
        ge=1,
        description="After SIGTERM (a stop or cancel), how long the job may take to checkpoint before SIGKILL.",
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Names of this process's variables the job gets (e.g. AWS_* for an MLflow "
        "artifact store); their values go through the 0600 file, never into the container's configuration.",
    )
    keep_finished_containers: bool = Field(
        False,
        description="Keep a job's container once it ended (docker inspect/logs); its log and end are saved "
        "in the job's directory either way.",
    )
    poll_interval_start: float = Field(
        0.1, gt=0, description="First wait between two polls, in seconds (a poll is one inspect of the container)."
    )
    poll_interval_max: float = Field(5.0, gt=0, description="Longest wait between two polls, in seconds.")

    # ---- checks ------------------------------------------------------------------------------

    @staticmethod
    def gpu_request(resources: Resources) -> GpuRequest:
        return GpuRequest(
            count=resources.gpus_per_node, devices=tuple(resources.gpu_devices), share=resources.share_gpus
        )

    def validate_job(self, job: TrainingJob) -> None:
        res = job.resources
        check_name(job.key, "job key", longest=128)
        if not job.workdir.startswith("/"):
            raise ConfigurationError(f"workdir {job.workdir!r} must be an absolute path (set workdir_root)")
        if res.nodes != 1:
            raise ConfigurationError(
                f"resources.nodes={res.nodes}: the Docker backend runs a job on one host; set nodes=1, or use a "
                "Slurm stack for multi-node jobs"
            )
        if job.image is None or not job.image.reference:
            raise ConfigurationError(
                "the Docker backend runs the job in the workload's image, and the job has none: use a stack whose "
                "image builder builds one (DockerImageBuilder) and a gpuferry.yaml with an image section"
            )
        check_pinned_image(job.image.reference, "job.image.reference")
        if res.gpus_per_node and res.processes_per_node > res.gpus_per_node:
            raise ConfigurationError(
                f"resources.processes_per_node={res.processes_per_node} exceeds gpus_per_node={res.gpus_per_node}: "
                "use one process per GPU"
            )
        launch_command(job.command, "python", res.processes_per_node)
        check_env_names(self.pass_env, "pass_env")
        for mount in self.mounts:
            if not mount.startswith("/") or ":" in mount:
                raise ConfigurationError(f"mounts: {mount!r} must be an absolute path without ':'")
        self.check_gpu_request(self.gpu_request(res), required=False)

    # ---- submit ------------------------------------------------------------------------------

    def container_of(self, key: str) -> str:
        return container_name("gpuferry-job", key)

    def submit(self, job: TrainingJob) -> JobHandle:
        self.validate_job(job)
        request = self.gpu_request(job.resources)
        inventory = self.check_gpu_request(request, required=True)
        workdir = Path(job.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        engine = self.engine()
        name = self.container_of(job.key)
        with _locked(workdir):
            state = _read_json(workdir / STATE_NAME)
            if state is not None and state["key"] != job.key:
                raise ConfigurationError(f"{workdir} already holds job {state['key']!r}; give job {job.key!r} its own")
            existing = engine.inspect(name)
            if state is not None or existing is not None:
                return self._adopt(job, workdir, state, existing)
            assert job.image is not None and job.image.reference  # validate_job
            engine.ensure_image(job.image.reference, self.registry_credentials)
            secrets = self._secret_values(job)
            secret_file = str(workdir / SECRET_ENV_NAME) if secrets else None
            gpu_mode = self.resolved_gpu_mode() if request.wanted else "cdi"

            def build(gpus: list[HostGpu]) -> Any:
                return self._container(job, name, gpus, request, gpu_mode, secret_file)

            try:
                container, gpus = engine.create_with_gpus(inventory, request, build, host=self.host_label)
            except NameInUse:  # another process submitted the same job a moment ago
                return self._adopt(job, workdir, None, engine.inspect(name))
            state = {
                "key": job.key,
                "container": name,
                "container_id": container,
                "attempt": 0,
                "max_requeues": job.resources.max_requeues,
                "cancelled": False,
                "submitted": time.time(),
                "requeued_exits": [],
                "gpus": [g.describe() for g in gpus],
                "program": job.command[0],
                "memory_mb": _memory_mb(job),
            }
            _write_json(workdir / STATE_NAME, state)
            try:
                self._write_secrets(workdir, secrets)
                engine.start(container)
            except BaseException:
                engine.remove(container)
                for name in (STATE_NAME, SECRET_ENV_NAME):
                    (workdir / name).unlink(missing_ok=True)
                raise
        where = f" on GPU(s) {', '.join(state['gpus'])}" if gpus else ""
        run_logger().info("job %s: container %s started on %s%s", job.key, name, self.host_label, where)
        return self._handle(job.key, workdir)

    def _container(
        self,
        job: TrainingJob,
        name: str,
        gpus: list[HostGpu],
        request: GpuRequest,
        gpu_mode: str,
        secret_file: str | None,
    ) -> Any:
        assert job.image is not None and job.image.reference
        res = job.resources
        labels = {LABEL_KIND: "job", LABEL_JOB_KEY: job.key, LABEL_WORKDIR: job.workdir}
        if gpus:
            labels.update({LABEL_GPUS: claim_label(gpus), LABEL_GPU_SHARING: str(request.share).lower()})
        return training_container(
            name=name,
            image=job.image.reference,
            command=launch_command(job.command, "python", res.processes_per_node),
            env=job_environment(job, Path(job.workdir)),
            labels=labels,
            workdir=job.workdir,
            image_workdir=job.image.workdir,
            gpus=self.device_ids(gpus, request, gpu_mode) if gpus else (),
            gpu_count=len(gpus),
            gpu_mode=gpu_mode,
            mounts=self.mounts,
            user=self.user,
            network=self.network_mode,
            shm_size_mb=self.shm_size_mb,
            memory_mb=_memory_mb(job),
            stop_timeout_s=self.stop_timeout_seconds,
            secret_file=secret_file,
        )

    def _secret_values(self, job: TrainingJob) -> dict[str, str]:
        values = job_secret_values(job)
        values.update({name: os.environ[name] for name in self.pass_env if name in os.environ})
        return values

    def _write_secrets(self, workdir: Path, values: dict[str, str]) -> None:
        """The 0600 file the container's shell sources (the job's user must read it; nobody else may)."""
        if not values:
            return
        path = workdir / SECRET_ENV_NAME
        write_secret_env(path, values)
        uid = (self.user or "").split(":")[0]
        if uid.isdigit() and os.geteuid() == 0:
            os.chown(path, int(uid), -1)

    def _adopt(
        self, job: TrainingJob, workdir: Path, state: dict[str, Any] | None, existing: dict[str, Any] | None
    ) -> JobHandle:
        if state is None:
            if existing is None:
                raise ConfigurationError(f"job {job.key}: its container vanished while being adopted; submit again")
            labels = existing["Config"].get("Labels") or {}
            if labels.get(LABEL_JOB_KEY) != job.key:
                raise ConfigurationError(
                    f"a container named {existing['Name'].lstrip('/')} exists but is not job {job.key}'s; remove it"
                )
            known = {g.key: g.describe() for g in self.inventory() or []}
            gpus = [known.get(key, key) for key in parse_claim_label(labels.get(LABEL_GPUS))]  # what it holds
            state = {
                "key": job.key,
                "container": existing["Name"].lstrip("/"),
                "container_id": existing["Id"],
                "attempt": 0,
                "max_requeues": job.resources.max_requeues,
                "cancelled": False,
                "submitted": time.time(),
                "requeued_exits": [],
                "gpus": gpus,
                "program": job.command[0],
                "memory_mb": _memory_mb(job),
            }
            _write_json(workdir / STATE_NAME, state)
        if existing is not None and existing["State"]["Status"] == "created" and not state["cancelled"]:
            self.engine().start(state["container"])  # its submitter stopped between create and start
        run_logger().info("job %s: adopted its container %s", job.key, state["container"])
        return self._handle(job.key, workdir)

    def _handle(self, key: str, workdir: Path) -> JobHandle:
        return JobHandle(
            backend=self.backend_name,
            job_id=self.container_of(key),
            key=key,
            workdir=str(workdir),
            log_path=str(workdir / LOG_NAME),
        )

    # ---- state -------------------------------------------------------------------------------

    def poll(self, handles: Iterable[JobHandle]) -> dict[str, JobStatus]:
        arrays, jobs = array_handles(handles)
        out = {handle.job_id: self._array_status(handle) for handle in arrays}
        out.update({h.job_id: self._status(Path(h.workdir), h.job_id) for h in jobs})
        return out

    def _status(self, workdir: Path, job_id: str) -> JobStatus:
        ended = _read_json(workdir / EXIT_RECORD)
        if ended is not None:
            return _recorded(job_id, ended)
        state = _read_json(workdir / STATE_NAME)
        if state is None:
            return JobStatus(job_id=job_id, state="FAILED", reason=f"no job state in {workdir}")
        info = self.engine().inspect(state["container"])
        elapsed = time.time() - state["submitted"]
        status = info["State"]["Status"] if info is not None else None
        if status in _RUNNING:
            return JobStatus(job_id=job_id, state="RUNNING", elapsed_seconds=elapsed)
        if status == "created" and not state["cancelled"]:
            return JobStatus(job_id=job_id, state="PENDING", elapsed_seconds=elapsed)
        with _locked(workdir):  # one poller decides what an exit means; the others read its record
            ended = _read_json(workdir / EXIT_RECORD)
            if ended is not None:
                return _recorded(job_id, ended)
            state = _read_json(workdir / STATE_NAME) or state
            info = self.engine().inspect(state["container"])
            return self._after_exit(workdir, job_id, state, info)

    def _after_exit(self, workdir: Path, job_id: str, state: dict[str, Any], info: dict[str, Any] | None) -> JobStatus:
        elapsed = time.time() - state["submitted"]
        if info is None:
            return self._end(
                workdir,
                job_id,
                state,
                None,
                "FAILED",
                None,
                "the job's container is gone (removed from outside?) and its exit was not recorded",
            )
        st = info["State"]
        if st["Status"] in _RUNNING:  # restarted by another poller meanwhile
            return JobStatus(job_id=job_id, state="RUNNING", elapsed_seconds=elapsed)
        code = st.get("ExitCode") if st["Status"] != "created" else None
        if code == contract.EXIT_OK:
            return self._end(workdir, job_id, state, info, "COMPLETED", code, "")
        if state["cancelled"]:
            return self._end(workdir, job_id, state, info, "CANCELLED", code, "cancelled on request")
        marker = workdir / "checkpoints" / contract.PREEMPTED_MARKER
        preempted = code == contract.EXIT_PREEMPTED or (code not in (None, 0) and marker.exists())
        if preempted and state["attempt"] < state["max_requeues"]:
            finished = st.get("FinishedAt")
            if finished not in state["requeued_exits"]:
                state["attempt"] += 1
                state["requeued_exits"].append(finished)
                _write_json(workdir / STATE_NAME, state)
                self.engine().start(state["container"])
                run_logger().info(
                    "job %s: stopped with exit %s after saving a checkpoint: started again (attempt %d) to resume",
                    state["key"],
                    code,
                    state["attempt"],
                )
            return JobStatus(
                job_id=job_id,
                state="REQUEUED",
                exit_code=code,
                elapsed_seconds=elapsed,
                reason=f"preempted; requeued (attempt {state['attempt']})",
            )
        if preempted:
            return self._end(
                workdir,
                job_id,
                state,
                info,
                "FAILED",
                code,
                f"{explain_exit_code(contract.EXIT_PREEMPTED)}: {state['attempt']} requeues done",
            )
        name, reason = container_exit_reason(
            code,
            oom_killed=bool(st.get("OOMKilled")),
            memory_mb=state.get("memory_mb"),
            program=state.get("program", ""),
        )
        return self._end(workdir, job_id, state, info, name, code, reason)

    def _end(
        self,
        workdir: Path,
        job_id: str,
        state: dict[str, Any],
        info: dict[str, Any] | None,
        name: str,
        code: int | None,
        reason: str,
    ) -> JobStatus:
        """Record how the job ended — its log first, then ``exit.json`` — and remove its container."""
        engine = self.engine()
        raw = engine.raw_logs(state["container"]) if info is not None else None
        if raw is not None:
            save(workdir / LOG_NAME, raw)
        elapsed = time.time() - state["submitted"]
        record = {
            "state": name,
            "exit_code": code,
            "reason": reason,
            "elapsed_seconds": elapsed,
            "oom_killed": bool(info and info["State"].get("OOMKilled")),
            "ended": time.time(),
        }
        _write_json(workdir / EXIT_RECORD, record)
        (workdir / SECRET_ENV_NAME).unlink(missing_ok=True)
        if info is not None and not self.keep_finished_containers:
            engine.remove(state["container"])
        return _recorded(job_id, record)

    def cancel(self, handle: JobHandle) -> None:
        if is_array(handle):
            self._cancel_array(handle)
            return
        workdir = Path(handle.workdir)
        with _locked(workdir):
            state = _read_json(workdir / STATE_NAME)
            if state is None or (workdir / EXIT_RECORD).exists():
                return
            state["cancelled"] = True
            _write_json(workdir / STATE_NAME, state)
        # SIGTERM, then SIGKILL after the grace period: the job checkpoints; the next poll records CANCELLED.
        self.engine().stop(state["container"], timeout=self.stop_timeout_seconds)

    def _requeues(self, handle: JobHandle) -> int:
        return self._task_requeues(Path(handle.workdir))

    # ---- sweeps: job arrays of containers (blocks/base/arrays.py) -------------------------------

    def _job_ended(self, workdir: Path) -> bool | None:
        if not (workdir / STATE_NAME).exists():
            return None
        return (workdir / EXIT_RECORD).exists() or self._status(workdir, workdir.name).terminal

    def _task_requeues(self, task: Path) -> int:
        state = _read_json(task / STATE_NAME)
        return 0 if state is None else int(state["attempt"])

    def _room(self, job: TrainingJob) -> int:
        """As many tasks as the host's GPUs hold (``gpus_per_node`` each), or its cores when they ask for none."""
        res = job.resources
        if res.gpus_per_node:
            return max(1, len(self.inventory() or []) // res.gpus_per_node)
        engine = self.engine()
        with engine.calling("describe itself"):
            cores = int(engine.client.info().get("NCPU") or 1)
        return max(1, cores // (res.cpus_per_task * res.processes_per_node))

    def _start_task(self, task: TrainingJob) -> bool:
        """A task whose GPUs other jobs hold waits for the next poll (the allocator chooses a task's GPUs)."""
        try:
            self.submit(task)
        except GpusBusy as exc:
            run_logger().info("sweep task %s waits for GPUs: %s", task.key, exc)
            return False
        return True

    # ---- output ------------------------------------------------------------------------------

    def read_log(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """The job's new output since ``offset`` (an engine-timestamp offset: see ``docker_engine.read_from``)."""
        workdir = Path(handle.workdir)
        if not (workdir / EXIT_RECORD).exists():
            raw = self.engine().raw_logs(handle.job_id, since=offset_second(offset) or None)
            if raw is not None:
                return read_from(raw, offset, final=False)
        try:
            return read_from((workdir / LOG_NAME).read_bytes(), offset, final=True)
        except FileNotFoundError:
            return "", offset

    def log_tail(self, handle: JobHandle, lines: int = 30) -> str:
        workdir = Path(handle.workdir)
        if not (workdir / EXIT_RECORD).exists():
            text = self.engine().tail(handle.job_id, lines)
            if text is not None:
                return text
        try:
            return "\n".join(strip_timestamps((workdir / LOG_NAME).read_bytes()).splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The engine, the GPUs it offers and those in use, the login it pulls images with (``check.py``)."""
        from blocks.docker.check import check_docker_host

        check_docker_host(self, probe, role="compute")
        return probe.rows


def _memory_mb(job: TrainingJob) -> int | None:
    return None if job.resources.mem_gb is None else max(6, int(job.resources.mem_gb * 1024))


def _recorded(job_id: str, record: dict[str, Any]) -> JobStatus:
    return JobStatus(
        job_id=job_id,
        state=record["state"],
        exit_code=record["exit_code"],
        reason=record["reason"],
        elapsed_seconds=record["elapsed_seconds"],
    )


@contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    with open(workdir / LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    save(path, json.dumps(data).encode())
