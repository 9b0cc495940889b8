"""Train on a Slurm cluster: sbatch over SSH (paramiko), one batched squeue per poll, sacct accounting.

``SlurmCluster`` is a ``ComputeBackend``. It reaches the cluster's login node over SSH — host key
checked against ``known_hosts`` (an unknown or changed key is refused, never added), one connection
reused and re-opened when it drops — or, with ``local=True``, runs the Slurm commands on this
machine (the flow runs on the login node). Every command is an argv list joined with
``shlex.quote``; no user value is ever formatted into a shell string.

* ``submit(job)`` is idempotent: before ``sbatch`` it adopts a live or finished job carrying the key.
* ``poll(handles)`` is ONE ``squeue`` of every watched job, plus one ``sacct`` for jobs the controller forgot.
* ``result()`` adds GPU-hours and CPU-hours from ``sacct``.
* Secrets never go into the batch script: they go to a 0600 file next to it over SFTP, which the script sources.

A ``TrainingJob`` with an image (pinned by digest) runs inside it: with pyxis where ``srun`` has
``--container-image``, else podman, else apptainer (``container_runtime``; "auto" asks the login node
once). The registry credentials go in a 0600 file next to the script, never into it.

This file is the block (its fields), the job's validation and batch script, and where the trained model is
read and stored. Its parts live beside it in ``blocks/slurm/``, each a mixin of the block or pure functions:
``transport.py`` (the connection, commands and files), ``submit.py`` (code shipped, submit and adopt),
``jobs.py`` (log, poll, cancel, accounting), ``state.py`` (what squeue, sacct, sinfo, sbatch and scontrol
answer, read: pure), ``script.py`` (the batch script, pure; its container part in ``script_image.py``),
``containers.py`` (jobs in the image), ``arrays.py`` (sweeps as job arrays), ``store.py`` (the trained model
stored from the cluster), ``housekeeping.py`` (what ``gpuferry gc`` frees there) and ``check.py`` (what
``gpuferry check`` asks).
"""

from __future__ import annotations

import posixpath
import threading
import time
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from prefect_docker.credentials import DockerRegistryCredentials
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from blocks.base.compute import ComputeBackend
from blocks.base.mlflow_model import ModelInfo
from blocks.base.storage import CheckpointStore
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError
from blocks.records import CheckpointRef, TrainingJob
from blocks.slurm import store as remote_store
from blocks.slurm.arrays import TASKS_DIR, SlurmArrays
from blocks.slurm.containers import SlurmContainers
from blocks.slurm.housekeeping import SlurmHousekeeping
from blocks.slurm.jobs import SlurmJobs
from blocks.slurm.script import ADDITIONAL_DIRECTIVES, check_name, sbatch_script
from blocks.slurm.script_image import PODMAN_OPTIONS
from blocks.slurm.state import KEY_COMMENT_PREFIX, partitions_from_sinfo
from blocks.slurm.submit import SECRETS_NAME, SlurmSubmit
from blocks.slurm.transport import SlurmTransport
from blocks.ssh.credentials import CREDENTIAL_FIELDS, SshCredentials, credentials_from_flat
from blocks.ssh.session import SshSession
from blocks.values import check_pinned_image
from runtime import contract


class SlurmCluster(
    SlurmTransport, SlurmSubmit, SlurmJobs, SlurmContainers, SlurmArrays, SlurmHousekeeping, ComputeBackend
):
    """Training jobs as Slurm batch jobs, submitted over SSH (or on the login node itself)."""

    _block_type_name = "gpuferry Slurm Cluster"
    enforces_time_limit: ClassVar[bool] = True  # --time: Slurm ends (or requeues) a job past its limit
    supports_arrays: ClassVar[bool] = True
    _description = "Runs training jobs on a Slurm cluster: sbatch over SSH, batched squeue polling, sacct accounting."
    # A validation error never echoes its input: the input may hold the private key.
    model_config = ConfigDict(hide_input_in_errors=True)
    # The older flat credential fields, as a stack file may still name them (``blocks/stack_file.py``).
    field_aliases: ClassVar[dict[str, tuple[str, str]]] = {f: ("credentials", f) for f in CREDENTIAL_FIELDS}

    local: bool = Field(False, description="Run Slurm commands on this machine (the flow runs on the login node).")
    host: str | None = Field(None, description="SSH host of the login node.")
    port: int = Field(22, ge=1, le=65535, description="SSH port of the login node.")
    credentials: SshCredentials | None = Field(
        None,
        description="SSH login to the login node: user (the Slurm user the jobs run as), private key, "
        "known_hosts. Not needed with local=True. (The older flat fields user, private_key, "
        "private_key_passphrase and known_hosts still load into it.)",
    )
    connect_timeout: float = Field(15.0, gt=0, description="Seconds to wait for the SSH connection.")
    command_timeout: float = Field(120.0, gt=0, description="Seconds one Slurm command may take.")
    slurm_conf: str | None = Field(
        None, description="SLURM_CONF for every command (None: the login node's default /etc/slurm/slurm.conf)."
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="local=True: variables of this process the Slurm commands get besides "
        "PATH, HOME, the locale and SLURM_CONF, and with them the jobs (sbatch exports its environment), e.g. "
        "LD_LIBRARY_PATH of the login node's modules; nothing else of this environment reaches a job.",
    )
    partition: str | None = Field(None, description="Default partition (None: the cluster's default).")
    account: str | None = Field(None, description="Default account (None: the user's default).")
    qos: str | None = Field(None, description="Default QoS (None: the association's default).")
    python: str = Field(
        "python3",
        description="Interpreter on the cluster that runs a leading `python` of the workload's command "
        "in jobs without an image (unless the workload's environment.python names one).",
    )
    code_root: str | None = Field(
        None,
        description="Directory on the cluster's shared filesystem where workloads' code is unpacked, one "
        "directory per content hash, sent once (None: .code under workdir_root).",
    )
    store_python: str | None = Field(
        None,
        description="Interpreter on the login node that stores trained models to the stack's store "
        "(python -m runtime.store; it needs PyYAML and boto3). None: python.",
    )
    store_timeout_seconds: float = Field(
        3600.0,
        gt=0,
        description="How long storing one trained model from the cluster may take.",
    )
    warning_signal: str | None = Field(
        "B:USR1@90", description="Signal sent ahead of the time limit so the job checkpoints (sbatch --signal)."
    )
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="Lowest torchrun rendezvous port on the first node.")
    rdzv_port_span: int = Field(
        1000,
        ge=1,
        le=64512,
        description="A multi-node job rendezvous on port rdzv_port + job id % rdzv_port_span "
        "(1: always rdzv_port), so jobs that share their first node do not collide.",
    )
    additional_directives: dict[str, str | bool] = Field(
        default_factory=dict,
        description=f"Extra sbatch directives for every job, from: {', '.join(sorted(ADDITIONAL_DIRECTIVES))}.",
    )
    adopt_lookback_days: int = Field(30, ge=1, description="How far back sacct is searched for a job to adopt.")
    container_runtime: Literal["auto", "pyxis", "podman", "apptainer"] = Field(
        "auto",
        description="How a job with an image runs inside it: pyxis (srun --container-image), podman or "
        "apptainer; auto: pyxis when the login node's srun has --container-image, else podman, else apptainer.",
    )
    container_mounts: list[str] = Field(
        default_factory=list,
        description="More host paths mounted at the same path in the container (datasets, a "
        "file-based MLflow store); the job's directory always is.",
    )
    container_runtime_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the container runtime itself on the nodes, e.g. "
        "CONTAINERS_CONF / CONTAINERS_REGISTRIES_CONF (podman) or ENROOT_ALLOW_HTTP (pyxis). Not secrets.",
    )
    podman_gpu_mode: Literal["cdi", "env"] = Field(
        "cdi",
        description="podman: cdi passes each allocated GPU as --device nvidia.com/gpu=<id> (nodes with "
        "`nvidia-ctk cdi generate`); env only passes CUDA_VISIBLE_DEVICES through.",
    )
    podman_options: list[str] = Field(
        default_factory=list,
        description="More `podman run` options for the job's container, from: "
        f"{', '.join(sorted(PODMAN_OPTIONS))} (e.g. --security-opt=label=disable on SELinux nodes, --ipc=host).",
    )
    registry_credentials: DockerRegistryCredentials | None = Field(
        None, description="Login for pulling the image on the nodes (sent as a 0600 file with the job)."
    )
    poll_interval_start: float = Field(0.5, gt=0, description="First wait between two polls, in seconds.")

    _lock: Any = PrivateAttr(default_factory=threading.RLock)
    _session: SshSession | None = PrivateAttr(None)
    _session_for: tuple[Any, ...] | None = PrivateAttr(None)
    _last_jobs: tuple[float, list[dict[str, Any]]] = PrivateAttr((0.0, []))
    _detected_runtime: tuple[tuple[Any, ...], str] | None = PrivateAttr(None)
    _known_partitions: tuple[tuple[Any, ...], float, list[str]] | None = PrivateAttr(None)
    _shipped_code: dict[tuple[Any, ...], dict[str, float]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_credentials(cls, data: Any) -> Any:
        return credentials_from_flat(data, "SlurmCluster")

    # ---- validation ------------------------------------------------------------------------

    @property
    def _cluster_key(self) -> tuple[Any, ...]:
        """Which cluster this block talks to, as the key of what it learns about it once (the container
        runtime, the partitions): a copy of the block with other settings asks again."""
        return (self.local, self.host, self.port, self.user, self.slurm_conf)

    def partitions(self) -> list[str]:
        _, out, _ = self.run(["sinfo", "-h", "-o", "%R"])
        known = partitions_from_sinfo(out)
        self._known_partitions = (self._cluster_key, time.monotonic(), known)
        return known

    def _check_partition(self, partition: str | None) -> None:
        if partition is None:
            return
        # A partition seen in the last minute is taken as there (preflight has just asked, and submit
        # asks again); one not seen is looked up afresh before it is refused.
        cached = self._known_partitions
        if (
            cached is not None
            and cached[0] == self._cluster_key
            and time.monotonic() - cached[1] < 60
            and partition in cached[2]
        ):
            return
        known = self.partitions()
        if partition not in known:
            raise ConfigurationError(
                f"partition {partition!r} does not exist on this cluster; set resources.partition to one of: "
                f"{', '.join(known) or '(none found)'}"
            )

    def _workdir_ok(self, workdir: str) -> None:
        if not posixpath.isabs(workdir):
            raise ConfigurationError(
                f"workdir {workdir!r} must be an absolute path on the cluster's shared filesystem (set workdir_root)"
            )

    def validate_job(self, job: TrainingJob) -> None:
        res = job.resources
        check_name(job.key, "job key")
        self._workdir_ok(job.workdir)
        if res.gpu_devices:
            raise ConfigurationError(
                f"resources.gpu_devices={res.gpu_devices}: Slurm chooses a job's GPUs itself; ask for a count "
                "(gpus_per_node), or use a Docker stack to name GPUs by index or UUID"
            )
        image = job.image.reference if job.image is not None else None
        if not image and job.code is None:
            raise ConfigurationError("the job has neither an image nor the workload's code (job.code) to ship")
        if res.gpus_per_node and res.processes_per_node > res.gpus_per_node:
            raise ConfigurationError(
                f"resources.processes_per_node={res.processes_per_node} exceeds gpus_per_node={res.gpus_per_node}: "
                "use one process per GPU"
            )
        if image:
            check_pinned_image(image, "job.image.reference")
            self.job_container_runtime()
        self._script_for_job(job)  # every option validated, nothing sent
        self._check_partition(res.partition or self.partition)

    # ---- submit ----------------------------------------------------------------------------

    def _common_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        for key in ("partition", "account", "qos"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        if self.additional_directives:
            options["additional"] = dict(self.additional_directives)
        return options

    def _script_for_job(
        self, job: TrainingJob, *, array_size: int | None = None, parallelism: int | None = None
    ) -> str:
        res = job.resources
        workdir = job.workdir
        env = {**job.env, "PYTHONUNBUFFERED": "1"}
        container = self._container_for_job(job)
        python = "python" if container is not None else job.python or self.python
        command = [python, *job.command[1:]] if job.command and job.command[0] == "python" else list(job.command)
        if array_size is None:
            env[contract.CHECKPOINT_DIR] = posixpath.join(workdir, "checkpoints")
            env[contract.PROGRESS_FILE] = posixpath.join(workdir, "progress.json")
        options = self._common_options()
        for key in ("partition", "account", "qos"):  # the run's own, over the stack's
            if getattr(res, key):
                options[key] = getattr(res, key)
        if res.nice is not None:
            options["additional"] = {**options.get("additional", {}), "nice": str(res.nice)}
        torchrun = res.processes_per_node > 1 or res.nodes > 1
        options.update(
            job_name=job.key,
            comment=KEY_COMMENT_PREFIX + job.key,
            nodes=res.nodes,
            ntasks_per_node=1,
            cpus_per_task=res.cpus_per_task * res.processes_per_node,
            gpus_per_node=res.gpus_per_node or None,
            time=res.time_limit_minutes,
            output=posixpath.join(workdir, "job.log"),
            requeue=True,
            env=env,
            requeue_exit_code=contract.EXIT_PREEMPTED,
            max_requeues=res.max_requeues,
        )
        if res.mem_gb is not None:
            options["mem"] = max(1, int(res.mem_gb * 1024))
        if self.warning_signal:
            options["signal"] = self.warning_signal
        if torchrun:
            options.update(
                torchrun_nproc_per_node=res.processes_per_node,
                torchrun_python=python,
                rdzv_port=self.rdzv_port,
                rdzv_port_span=self.rdzv_port_span,
            )
        if job.secrets or job.secret_env:  # the workload's secrets or the tracking login
            options["secret_env_file"] = posixpath.join(workdir, SECRETS_NAME)
        if array_size is not None:
            # One array task per configuration; each exports its own settings (checkpoint dir, progress
            # file, hyperparameters, MLflow run) from tasks/<index>.env, written next to the script.
            options.update(
                array=f"0-{array_size - 1}",
                array_parallelism=parallelism,
                output=posixpath.join(workdir, "task-%a.log"),
                array_env_dir=posixpath.join(workdir, TASKS_DIR),
            )
        if container is not None:
            options["container"] = container
        else:
            assert job.code is not None  # validate_job
            options["cwd"] = self.code_dir(job.code.sha256)
        return sbatch_script(command, workdir=workdir, **options)

    # ---- the trained model: read and stored on the cluster, whose filesystem this machine may not see ----

    def inspect_model(self, final_dir: str) -> ModelInfo:
        if self.local:
            return super().inspect_model(final_dir)
        return remote_store.inspect_remote(self, final_dir)

    def store_model(self, final_dir: str, store: CheckpointStore, name: str) -> CheckpointRef:
        if self.local:
            return super().store_model(final_dir, store, name)
        return remote_store.store_remote(self, final_dir, store, name)

    def check_store(self, store: CheckpointStore) -> None:
        if not self.local:
            store.remote_destination("preflight")  # a store the cluster cannot reach fails here, naming why

    def check_tracking(self, tracking_uri: str) -> None:
        if self.local:
            return
        if urlsplit(tracking_uri).scheme in ("", "file", "sqlite"):
            raise ConfigurationError(
                f"tracking.tracking_uri={tracking_uri!r} is a file on this machine: the jobs on the Slurm cluster "
                f"({self.host}) log to MLflow themselves and cannot reach it. Point tracking_uri at an MLflow server "
                "the cluster reaches (http(s)://...), or set compute.local=True when the flow runs on the login node."
            )

    def write_private(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` on the cluster, mode 0600 before a byte is written (its directory created)."""
        self._mkdir(posixpath.dirname(path))
        self._write(path, data, 0o600)

    # ---- checks ------------------------------------------------------------------------------

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """SSH (reach, host key, login), the Slurm version, partitions and their GPUs, the user's account and
        QoS, the container runtime, the interpreter and the jobs' directory (``blocks/slurm/check.py``)."""
        from blocks.slurm.check import check_slurm

        check_slurm(self, probe)
        return probe.rows
