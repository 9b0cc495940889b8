"""Train on a Slurm cluster: sbatch over SSH (paramiko), one batched squeue per poll, sacct accounting.

``SlurmCluster`` is a ``ComputeBackend``. It reaches the cluster's login node over SSH — host key
checked against ``known_hosts`` (an unknown or changed key is refused, never added), one connection
reused and re-opened when it drops — or, with ``local=True``, runs the Slurm commands on this
machine (the flow runs on the login node). Every command is an argv list joined with
``shlex.quote``; no user value is ever formatted into a shell string.

* ``submit(job)`` is idempotent: the job key is the Slurm job name and is also in its comment
  (``gpuferry-key:<key>``). Before ``sbatch`` it looks for a live job (``squeue``) or a finished
  one (``sacct``) carrying the key and adopts it, so a retried submit never makes a second job. If
  the connection drops *during* sbatch the error is transient: the retry finds the job by its key.
* ``poll(handles)`` is ONE ``squeue -j <every watched job>`` (text fields: ``squeue --json`` in
  22.05 ignores ``-j`` and serialises every job the controller holds), plus one ``sacct`` for jobs
  that left the controller's memory.
* ``result()`` adds GPU-hours (allocated ``gres/gpu`` × elapsed, every attempt of a requeued job)
  and CPU-hours from ``sacct``.

Secrets never go into the batch script: ``submit_command(secret_env=...)`` writes them to a 0600
file next to it over SFTP, which the script sources.

A ``TrainingJob`` with an image (pinned by digest) runs inside it: with pyxis where ``srun`` has
``--container-image``, else podman, else apptainer (``container_runtime``; "auto" asks the login node
once). The registry credentials go in a 0600 file next to the script, never into it.

This file is the block (its fields) and the job's life: validation, submit and adopt, polling, cancel,
accounting. Its parts live beside it: ``slurm_ssh.py`` (the connection, commands and files),
``slurm_state.py`` (squeue and sacct output read, pure), ``slurm_script.py`` (the batch script, pure),
``slurm_containers.py`` (jobs in the image) and ``slurm_arrays.py`` (sweeps as job arrays).
"""

from __future__ import annotations

import json
import posixpath
import shlex
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from prefect_docker.credentials import DockerRegistryCredentials
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from blocks import remote_store
from blocks.backoff import Poll
from blocks.checks import CheckRow, Probe
from blocks.compute import ComputeBackend, run_logger
from blocks.errors import ConfigurationError, JobFailed, TransientError, explain_exit_code
from blocks.mlflow_model import ModelInfo
from blocks.secrets import job_secret_values
from blocks.slurm_arrays import TASKS_DIR, SlurmArrays
from blocks.slurm_containers import ENROOT_CREDENTIALS_NAME, REGISTRY_AUTH_NAME, SlurmContainers
from blocks.slurm_script import ADDITIONAL_DIRECTIVES, PODMAN_OPTIONS, check_name, check_pinned_image, sbatch_script
from blocks.slurm_ssh import SlurmTransport
from blocks.ssh_credentials import CREDENTIAL_FIELDS, SshCredentials, credentials_from_flat
from blocks.ssh_session import SshSession
from blocks.slurm_state import (
    SACCT_STATUS_FORMAT, SACCT_USAGE_FORMAT, accounting_settled, aggregate, parse_squeue, squeue_argv,
    status_from_squeue, statuses_from_sacct, usage, usage_rows,
)  # fmt: skip
from blocks.specs import CheckpointRef, CodeRef, JobHandle, JobResult, JobStatus, TrainingJob
from blocks.storage import CheckpointStore
from runtime import contract

KEY_COMMENT_PREFIX = "gpuferry-key:"
SCRIPT_NAME = "job.sbatch"
SECRETS_NAME = ".secret.env"


class SlurmCluster(SlurmTransport, SlurmContainers, SlurmArrays, ComputeBackend):
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
        None, description="SSH login to the login node: user (the Slurm user the jobs run as), private key, "
        "known_hosts. Not needed with local=True. (The older flat fields user, private_key, "
        "private_key_passphrase and known_hosts still load into it.)",
    )  # fmt: skip
    connect_timeout: float = Field(15.0, gt=0, description="Seconds to wait for the SSH connection.")
    command_timeout: float = Field(120.0, gt=0, description="Seconds one Slurm command may take.")
    slurm_conf: str | None = Field(
        None, description="SLURM_CONF for every command (None: the login node's default /etc/slurm/slurm.conf)."
    )
    pass_env: list[str] = Field(
        default_factory=list, description="local=True: variables of this process the Slurm commands get besides "
        "PATH, HOME, the locale and SLURM_CONF, and with them the jobs (sbatch exports its environment), e.g. "
        "LD_LIBRARY_PATH of the login node's modules; nothing else of this environment reaches a job.",
    )
    partition: str | None = Field(None, description="Default partition (None: the cluster's default).")
    account: str | None = Field(None, description="Default account (None: the user's default).")
    qos: str | None = Field(None, description="Default QoS (None: the association's default).")
    python: str = Field(
        "python3", description="Interpreter on the cluster that runs a leading `python` of the workload's command "
        "in jobs without an image (unless the workload's environment.python names one).",
    )
    code_root: str | None = Field(
        None, description="Directory on the cluster's shared filesystem where workloads' code is unpacked, one "
        "directory per content hash, sent once (None: .code under workdir_root).",
    )
    store_python: str | None = Field(
        None, description="Interpreter on the login node that stores trained models to the stack's store "
        "(python -m runtime.store; it needs PyYAML and boto3). None: python.",
    )
    store_timeout_seconds: float = Field(
        3600.0, gt=0, description="How long storing one trained model from the cluster may take.",
    )
    warning_signal: str | None = Field(
        "B:USR1@90", description="Signal sent ahead of the time limit so the job checkpoints (sbatch --signal)."
    )
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="Lowest torchrun rendezvous port on the first node.")
    rdzv_port_span: int = Field(
        1000, ge=1, le=64512, description="A multi-node job rendezvous on port rdzv_port + job id % rdzv_port_span "
        "(1: always rdzv_port), so jobs that share their first node do not collide.",
    )
    additional_directives: dict[str, str | bool] = Field(
        default_factory=dict,
        description=f"Extra sbatch directives for every job, from: {', '.join(sorted(ADDITIONAL_DIRECTIVES))}.",
    )
    adopt_lookback_days: int = Field(30, ge=1, description="How far back sacct is searched for a job to adopt.")
    container_runtime: Literal["auto", "pyxis", "podman", "apptainer"] = Field(
        "auto", description="How a job with an image runs inside it: pyxis (srun --container-image), podman or "
        "apptainer; auto: pyxis when the login node's srun has --container-image, else podman, else apptainer.",
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="More host paths mounted at the same path in the container (datasets, a "
        "file-based MLflow store); the job's directory always is.",
    )
    container_runtime_env: dict[str, str] = Field(
        default_factory=dict, description="Environment of the container runtime itself on the nodes, e.g. "
        "CONTAINERS_CONF / CONTAINERS_REGISTRIES_CONF (podman) or ENROOT_ALLOW_HTTP (pyxis). Not secrets.",
    )
    podman_gpu_mode: Literal["cdi", "env"] = Field(
        "cdi", description="podman: cdi passes each allocated GPU as --device nvidia.com/gpu=<id> (nodes with "
        "`nvidia-ctk cdi generate`); env only passes CUDA_VISIBLE_DEVICES through.",
    )
    podman_options: list[str] = Field(
        default_factory=list, description="More `podman run` options for the job's container, from: "
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
    _shipped_code: dict[tuple[Any, ...], set[str]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_credentials(cls, data: Any) -> Any:
        return credentials_from_flat(data, "SlurmCluster")

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

    # ---- validation ------------------------------------------------------------------------

    @property
    def _cluster_key(self) -> tuple[Any, ...]:
        """Which cluster this block talks to, as the key of what it learns about it once (the container
        runtime, the partitions): a copy of the block with other settings asks again."""
        return (self.local, self.host, self.port, self.user, self.slurm_conf)

    def partitions(self) -> list[str]:
        _, out, _ = self.run(["sinfo", "-h", "-o", "%R"])
        known = sorted({line.strip() for line in out.splitlines() if line.strip()})
        self._known_partitions = (self._cluster_key, time.monotonic(), known)
        return known

    def _check_partition(self, partition: str | None) -> None:
        if partition is None:
            return
        # A partition seen in the last minute is taken as there (preflight has just asked, and submit
        # asks again); one not seen is looked up afresh before it is refused.
        cached = self._known_partitions
        if (cached is not None and cached[0] == self._cluster_key and time.monotonic() - cached[1] < 60
                and partition in cached[2]):  # fmt: skip
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

    def _script_for_job(self, job: TrainingJob, *, array_size: int | None = None,
                        parallelism: int | None = None) -> str:  # fmt: skip
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
        if res.partition:
            options["partition"] = res.partition
        torchrun = res.processes_per_node > 1 or res.nodes > 1
        options.update(
            job_name=job.key, comment=KEY_COMMENT_PREFIX + job.key, nodes=res.nodes,
            ntasks_per_node=1, cpus_per_task=res.cpus_per_task * res.processes_per_node,
            gpus_per_node=res.gpus_per_node or None, time=res.time_limit_minutes,
            output=posixpath.join(workdir, "job.log"), requeue=True, env=env,
            requeue_exit_code=contract.EXIT_PREEMPTED, max_requeues=res.max_requeues,
        )  # fmt: skip
        if res.mem_gb is not None:
            options["mem"] = max(1, int(res.mem_gb * 1024))
        if self.warning_signal:
            options["signal"] = self.warning_signal
        if torchrun:
            options.update(torchrun_nproc_per_node=res.processes_per_node, torchrun_python=python,
                           rdzv_port=self.rdzv_port, rdzv_port_span=self.rdzv_port_span)  # fmt: skip
        if job.secrets or job.secret_env:  # the workload's secrets or the tracking login
            options["secret_env_file"] = posixpath.join(workdir, SECRETS_NAME)
        if array_size is not None:
            # One array task per configuration; each exports its own settings (checkpoint dir, progress
            # file, hyperparameters, MLflow run) from tasks/<index>.env, written next to the script.
            options.update(
                array=f"0-{array_size - 1}", array_parallelism=parallelism,
                output=posixpath.join(workdir, "task-%a.log"),
                array_env_dir=posixpath.join(workdir, TASKS_DIR),
            )  # fmt: skip
        if container is not None:
            options["container"] = container
        else:
            assert job.code is not None  # validate_job
            options["cwd"] = self.code_dir(job.code.sha256)
        return sbatch_script(command, workdir=workdir, **options)

    # ---- the workload's code, shipped once per content ------------------------------------------

    def code_dir(self, sha256: str) -> str:
        """Where the code with archive hash ``sha256`` is unpacked on the cluster."""
        root = self.code_root or posixpath.join(self.workdir_root or posixpath.dirname(self.job_workdir("x")), ".code")
        return posixpath.join(root, sha256[:24])

    # Unpack the archive on stdin into "$1" unless it is there: checked against its sha256 ("$2") first, unpacked
    # beside the target and renamed into place, so a directory that exists is complete.
    _UNPACK_SH: ClassVar[str] = (
        'set -e; [ -f "$1/.complete" ] && exit 0; mkdir -p "$(dirname "$1")"; tmp="$1.tmp.$$"; '
        'rm -rf "$tmp"; mkdir "$tmp"; cat > "$tmp.tar.gz"; '
        'echo "$2  $tmp.tar.gz" | sha256sum -c --status || { rm -rf "$tmp" "$tmp.tar.gz"; '
        'echo "the code archive arrived damaged (sha256 mismatch)" >&2; exit 3; }; '
        'tar -xzf "$tmp.tar.gz" -C "$tmp"; rm -f "$tmp.tar.gz"; touch "$tmp/.complete"; '
        'mv -T "$tmp" "$1" 2>/dev/null || { [ -f "$1/.complete" ] && rm -rf "$tmp"; }'
    )

    def ship_code(self, job: TrainingJob) -> str | None:
        """Put the job's code on the cluster (once per content) and return its directory there; None for a job
        that runs in an image (its code is in the image)."""
        if job.image is not None and job.image.reference:
            return None
        assert job.code is not None  # validate_job
        return self.ship_archive(job.code, self.code_dir(job.code.sha256), "the workload's code")

    def ship_archive(self, code: CodeRef, target: str, what: str) -> str:
        """Unpack the archive ``code`` at ``target`` on the cluster unless it is there already (checked against
        its sha256 on arrival); returns ``target``."""
        with self._lock:
            shipped = self._shipped_code.get(self._cluster_key, set())
            if target in shipped:
                return target
        rc, _, _ = self.run(["test", "-f", posixpath.join(target, ".complete")], check=False)
        if rc != 0:
            data = Path(code.archive).read_bytes()
            self.run(["sh", "-c", self._UNPACK_SH, "sh", target, code.sha256], stdin=data)
            run_logger().info("shipped %s (%d files, %d bytes, sha256 %s) to %s", what, code.files, code.size_bytes,
                              code.sha256[:12], target)  # fmt: skip
        with self._lock:
            self._shipped_code.setdefault(self._cluster_key, set()).add(target)
        return target

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

    # ---- submit and adopt: the job key is the job's name (and in its comment) ----------------------------

    def _secret_env(self, job: TrainingJob) -> dict[str, SecretStr]:
        return {name: SecretStr(value) for name, value in job_secret_values(job).items()}

    def submit(self, job: TrainingJob) -> JobHandle:
        self.validate_job(job)
        self.ship_code(job)
        return self._submit(job.key, job.workdir, self._script_for_job(job), array=False,
                            secret_env=self._secret_env(job), secret_files=self._container_files(job))  # fmt: skip

    def submit_command(
        self, key: str, command: Sequence[str], *, workdir: str | None = None,
        env: Mapping[str, str] | None = None, secret_env: Mapping[str, SecretStr] | None = None,
        **sbatch_options: Any,
    ) -> JobHandle:  # fmt: skip
        """Submit ``command`` (an argv list) as a batch job — or, with ``array=``, as a job array.

        Idempotent like ``submit``. ``sbatch_options`` are those of ``blocks.slurm_script.sbatch_script``
        (the job name, comment, output and workdir are set here). Array tasks log to ``task-<index>.log``.
        ``secret_env`` reaches the job through a 0600 file next to the script, never the script itself.
        """
        check_name(key, "job key")
        workdir = workdir or self.job_workdir(key)
        self._workdir_ok(workdir)
        for reserved in ("job_name", "comment", "output", "error"):
            if reserved in sbatch_options:
                raise ConfigurationError(f"{reserved} is set by submit_command (the job key and its workdir)")
        array = sbatch_options.get("array") is not None
        options = {**self._common_options(), **sbatch_options}
        log = posixpath.join(workdir, "task-%a.log" if array else "job.log")
        options.update(job_name=key, comment=KEY_COMMENT_PREFIX + key, output=log, env=dict(env or {}))
        if secret_env:
            options["secret_env_file"] = posixpath.join(workdir, SECRETS_NAME)
        script = sbatch_script(list(command), workdir=workdir, **options)
        self._check_partition(options.get("partition"))
        return self._submit(key, workdir, script, array=array, secret_env=secret_env)

    def _submit(self, key: str, workdir: str, script: str, *, array: bool, hold: bool = False,
                secret_env: Mapping[str, SecretStr] | None = None,
                secret_files: Mapping[str, bytes] | None = None) -> JobHandle:  # fmt: skip
        log = posixpath.join(workdir, "task-%a.log" if array else "job.log")
        existing = self.find_job(key)
        if existing is not None:
            return self._handle(existing, key, workdir, log)
        path = posixpath.join(workdir, SCRIPT_NAME)
        sbatch = ["sbatch", "--parsable", *(["--hold"] if hold else []), path]
        secrets: dict[str, bytes] = {}
        if secret_env:
            for name in secret_env:
                if not name.isidentifier():
                    raise ConfigurationError(f"secret_env name {name!r} is not a variable name")
            body = "".join(f"{n}={shlex.quote(v.get_secret_value())}\n" for n, v in sorted(secret_env.items()))
            secrets[SECRETS_NAME] = body.encode()
        secrets.update(secret_files or {})  # e.g. the registry login of the job's image
        # Secrets go over SFTP, each created 0600 before a byte is written; the script and sbatch
        # follow in one command.
        if secrets:
            self._mkdir(workdir)
            for name, data in secrets.items():
                if "/" in name:
                    self._mkdir(posixpath.join(workdir, posixpath.dirname(name)))
                self._write(posixpath.join(workdir, name), data, 0o600)
        try:
            _, out, _ = self._put_files(workdir, {SCRIPT_NAME: (script.encode(), 0o700)}, then=sbatch, retry=False)
        except TransientError as exc:
            raise TransientError(f"{exc} — the job may have been submitted; a retried submit adopts it by its key") from exc
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise TransientError(f"sbatch answered {out!r} instead of a job id")
        return self._handle(job_id, key, workdir, log)

    def _handle(self, job_id: str, key: str, workdir: str, log: str) -> JobHandle:
        return JobHandle(backend=self.backend_name, job_id=job_id, key=key, workdir=workdir, log_path=log)

    def find_job(self, key: str) -> str | None:
        """The id of a live or finished job carrying ``key`` (live ones first), or None."""
        comment = KEY_COMMENT_PREFIX + key
        live_lines, accounted = self._jobs_named(key)
        live = []
        for line in live_lines:
            job_id, name, job_comment = (line.split("|", 2) + ["", ""])[:3]
            if name == key and job_comment == comment and job_id.isdigit():
                live.append(job_id)
        if live:
            return min(live, key=int)
        # sacct has the comment only where AccountingStoreFlags=job_comment; the name alone is the key there.
        found = [line.split("|")[1].split("_")[0] for line in accounted
                 if line.count("|") >= 2 and line.split("|", 2)[2] in (comment, "")]  # fmt: skip
        return min(found, key=int) if found else None

    # squeue's and then sacct's jobs of one name ("$1"), since "$2"; a fixed script, the name an argument.
    _JOBS_NAMED_SH: ClassVar[str] = (
        'squeue -h -t all --name="$1" -o "%F|%j|%k" || exit; echo "-- sacct --"; '
        'exec sacct -X -n -P --name="$1" --starttime="$2" --format=JobIDRaw,JobID,Comment'
    )

    def _jobs_named(self, name: str) -> tuple[list[str], list[str]]:
        """The jobs named ``name``, asked in ONE command (each costs the login shell's start-up):
        the controller's in every state (a job that just finished is in its memory before sacct has
        it) as ``array job id|name|comment`` lines (text squeue filters by name; ``squeue --json``
        would return every job in memory), then the accounting database's of the last
        ``adopt_lookback_days`` as ``JobIDRaw|JobID|Comment`` lines."""
        argv = ["sh", "-c", self._JOBS_NAMED_SH, "sh", name, f"now-{self.adopt_lookback_days}days"]
        rc, out, err = self.run(argv, check=False)
        # squeue's lines start with a job id: the separator line cannot be one of them.
        live, separated, accounted = ("\n" + out).partition("\n-- sacct --\n")
        if rc != 0:
            self._raise_for(["sacct" if separated else "squeue", f"--name={name}"], rc, err or out)
        return [line for line in live.splitlines() if line], accounted.splitlines()

    # ---- state -----------------------------------------------------------------------------

    def _squeue(self, job_ids: Iterable[str] = ()) -> list[dict[str, Any]]:
        """The controller's records of ``job_ids`` (of every job it holds when none are given): ONE squeue
        (``blocks/slurm_state.py``); the last answer is kept for ``array_outcome``."""
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
        records: dict[str, list[dict[str, Any]]] = {j: [] for j in wanted}
        for record in self._squeue(wanted):  # ONE query for every watched job
            parent = str(record.get("array_job_id") or 0)
            own = str(record.get("job_id"))
            if parent in wanted and parent != "0":
                records[parent].append(record)
            elif own in wanted:
                records[own].append(record)
        statuses: dict[str, JobStatus] = {}
        missing = [j for j in wanted if not records[j]]
        for job_id in wanted - set(missing):
            statuses[job_id] = aggregate(job_id, [status_from_squeue(r) for r in records[job_id]])
        if missing:
            statuses.update(self._from_sacct(missing))
        return {h.job_id: statuses[h.job_id] for h in handles}

    def _from_sacct(self, job_ids: list[str]) -> dict[str, JobStatus]:
        _, out, _ = self.run(["sacct", "-X", "-n", "-P", "-j", ",".join(sorted(job_ids, key=int)),
                              f"--format={SACCT_STATUS_FORMAT}"])  # fmt: skip
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

    # The files a job reads its secrets and registry login from: needed while it may still (re)start.
    _SECRET_FILES: ClassVar[tuple[str, ...]] = (SECRETS_NAME, REGISTRY_AUTH_NAME, ENROOT_CREDENTIALS_NAME)

    def remove_job_secrets(self, handle: JobHandle) -> None:
        """Delete the job's secret and login files once it cannot start again (it ended, or was cancelled).
        Best effort: a failure is logged (the files are 0600, in the job's own directory)."""
        paths = [posixpath.join(handle.workdir, name) for name in self._SECRET_FILES]
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
            _, out, _ = self.run(["sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id,
                                  f"--format={SACCT_USAGE_FORMAT}"])  # fmt: skip
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
                f"Slurm job {handle.job_id} ended {status.state}: {status.reason or explain_exit_code(status.exit_code)}",
                state=status.state, exit_code=status.exit_code, log_tail=self.log_tail(handle),
            )  # fmt: skip
        usage = self.accounting(handle)
        return JobResult(
            handle=handle, status=status, checkpoint_dir=posixpath.join(handle.workdir, "checkpoints"),
            requeues=int(usage["requeues"]), wall_seconds=usage["wall_seconds"] or status.elapsed_seconds,
            gpu_hours=usage["gpu_hours"], cpu_hours=usage["cpu_hours"],
        )  # fmt: skip

    # ---- checks ------------------------------------------------------------------------------

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """SSH (reach, host key, login), the Slurm version, partitions and their GPUs, the user's account and
        QoS, the container runtime, the interpreter and the jobs' directory (``blocks/check_slurm.py``)."""
        from blocks.check_slurm import check_slurm

        check_slurm(self, probe)
        return probe.rows
