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
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import re
import select
import shlex
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import paramiko
from prefect_docker.credentials import DockerRegistryCredentials
from pydantic import Field, PrivateAttr, SecretStr

from blocks import remote_store
from blocks.checks import CheckRow, Probe
from blocks.compute import ComputeBackend, run_logger
from blocks.mlflow_model import ModelInfo
from blocks.storage import CheckpointStore
from blocks.secrets import secret_values
from blocks._ssh import connect_verified, load_private_key, parse_known_hosts
from blocks.errors import ConfigurationError, GpuferryError, JobFailed, TransientError, explain_exit_code
from blocks.docker_image import _registry_parts
from blocks.slurm_script import (
    ADDITIONAL_DIRECTIVES, CONTAINER_RUNTIMES, PODMAN_OPTIONS, Container, check_name, check_pinned_image, sbatch_script,
)  # fmt: skip
from blocks.specs import TERMINAL_STATES, CheckpointRef, CodeRef, JobHandle, JobResult, JobStatus, TrainingJob
from runtime import contract

KEY_COMMENT_PREFIX = "gpuferry-key:"
SCRIPT_NAME = "job.sbatch"
SECRETS_NAME = ".secret.env"
TASKS_DIR = "tasks"
MAX_ARRAY_TASKS = 1_000_000  # Slurm's own bound; a cluster's MaxArraySize is lower (sbatch then says so)
REGISTRY_AUTH_NAME = ".registry-auth.json"  # podman / apptainer --authfile
ENROOT_CREDENTIALS_NAME = ".enroot/.credentials"  # pyxis: enroot reads ENROOT_CONFIG_PATH/.credentials

# Slurm job states -> ours. PREEMPTED / NODE_FAIL depend on whether the job will be requeued.
_PENDING = {"PENDING", "CONFIGURING", "SUSPENDED", "RESV_DEL_HOLD", "RESIZING", "POWER_UP_NODE", "STOPPED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "UPDATE_DB"}
_REQUEUED = {"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"}
_FAILED = {"FAILED", "BOOT_FAIL", "SPECIAL_EXIT", "DEADLINE", "LAUNCH_FAILED", "REVOKED"}


def map_state(slurm_state: str, *, requeue: bool, exit_code: int | None, reason: str = "") -> tuple[str, str]:
    """(our state, reason) for a Slurm state; PREEMPTED/REQUEUED/NODE_FAIL-with-requeue are not terminal."""
    state = slurm_state.split()[0].upper() if slurm_state else "PENDING"  # sacct: "CANCELLED by 0"
    if state in _PENDING:
        return "PENDING", reason
    if state in _RUNNING:
        return "RUNNING", reason
    if state in _REQUEUED:
        return "REQUEUED", reason or "requeued; it resumes from its last checkpoint"
    if state == "PREEMPTED":
        if requeue:
            return "PREEMPTED", "preempted by a higher-priority job; Slurm requeues it"
        return "FAILED", "preempted and not requeueable (submit with requeue=True to resume instead)"
    if state == "NODE_FAIL":
        if requeue:
            return "REQUEUED", "its node failed; Slurm requeues it"
        return "FAILED", "its node failed and the job is not requeueable"
    if state == "COMPLETED":
        return "COMPLETED", ""
    if state == "CANCELLED":
        return "CANCELLED", f"cancelled ({slurm_state})"
    if state == "TIMEOUT":
        return "TIMEOUT", "it ran past its time limit: raise resources.time_limit_minutes or checkpoint more often"
    if state == "OUT_OF_MEMORY":
        return "OUT_OF_MEMORY", "killed for exceeding its memory limit: raise resources.mem_gb"
    if state in _FAILED:
        return "FAILED", explain_exit_code(exit_code) if state == "FAILED" else f"Slurm state {state}"
    return "FAILED", f"unexpected Slurm state {slurm_state!r}"


def _wait_status_to_exit(raw: int | None) -> int | None:
    """squeue gives the wait status (code << 8 | signal); a signal becomes 128 + signal."""
    if raw is None:
        return None
    signal = raw & 0x7F
    return 128 + signal if signal else (raw >> 8) & 0xFF


def _sacct_exit(text: str) -> int | None:
    """sacct's "code:signal"."""
    try:
        code, signal = (int(x) for x in text.split(":"))
    except ValueError:
        return None
    return 128 + signal if signal else code


def _command_name(argv: Sequence[str]) -> str:
    """The program an ``env NAME=VALUE ... program`` command line runs."""
    return next((a for a in argv if a != "env" and not re.match(r"^[A-Z_]+=", a)), argv[0])


def _index_ranges(indexes: Iterable[int]) -> str:
    """Array task indexes as Slurm writes them: 0-4,7,9-12."""
    parts: list[str] = []
    run: list[int] = []
    for index in sorted(set(indexes)):
        if run and index != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(index)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


class SlurmCluster(ComputeBackend):
    """Training jobs as Slurm batch jobs, submitted over SSH (or on the login node itself)."""

    _block_type_name = "gpuferry Slurm Cluster"
    enforces_time_limit: ClassVar[bool] = True  # --time: Slurm ends (or requeues) a job past its limit
    supports_arrays: ClassVar[bool] = True
    _description = "Runs training jobs on a Slurm cluster: sbatch over SSH, batched squeue polling, sacct accounting."

    local: bool = Field(False, description="Run Slurm commands on this machine (the flow runs on the login node).")
    host: str | None = Field(None, description="SSH host of the login node.")
    port: int = Field(22, ge=1, le=65535, description="SSH port of the login node.")
    user: str | None = Field(None, description="SSH user (the Slurm user the jobs run as).")
    private_key: SecretStr | None = Field(None, description="SSH private key (OpenSSH or PEM text).")
    private_key_passphrase: SecretStr | None = Field(None, description="Passphrase of the private key, if any.")
    known_hosts: str = Field(
        "", description="known_hosts lines of the login node (`ssh-keyscan -p PORT HOST`); unknown keys are refused."
    )
    connect_timeout: float = Field(15.0, gt=0, description="Seconds to wait for the SSH connection.")
    command_timeout: float = Field(120.0, gt=0, description="Seconds one Slurm command may take.")
    slurm_conf: str | None = Field(
        None, description="SLURM_CONF for every command (None: the login node's default /etc/slurm/slurm.conf)."
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
    _client: paramiko.SSHClient | None = PrivateAttr(None)
    _sftp_client: paramiko.SFTPClient | None = PrivateAttr(None)
    _client_for: tuple[Any, ...] | None = PrivateAttr(None)
    _last_jobs: tuple[float, list[dict[str, Any]]] = PrivateAttr((0.0, []))
    _detected_runtime: tuple[tuple[Any, ...], str] | None = PrivateAttr(None)
    _known_partitions: tuple[tuple[Any, ...], float, list[str]] | None = PrivateAttr(None)
    _shipped_code: dict[tuple[Any, ...], set[str]] = PrivateAttr(default_factory=dict)

    _TERMINAL_SLURM: ClassVar[frozenset[str]] = frozenset(
        {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "NODE_FAIL",
         "PREEMPTED", "SPECIAL_EXIT"}
    )  # fmt: skip

    # ---- connection ------------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        if not self.host or not self.user or self.private_key is None:
            raise ConfigurationError("host, user and private_key are required unless local=True")
        key = load_private_key(
            self.private_key.get_secret_value(),
            self.private_key_passphrase.get_secret_value() if self.private_key_passphrase else None,
        )
        try:
            return connect_verified(
                address=self.host, port=self.port, user=self.user, key=key, known=parse_known_hosts(self.known_hosts),
                timeout=self.connect_timeout, name=f"{self.host}:{self.port}",
                check_against="matches the one the cluster's admins publish",
            )  # fmt: skip
        except GpuferryError:
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise TransientError(f"cannot reach the login node {self.host}:{self.port}: {exc}") from exc

    def _ssh(self) -> paramiko.SSHClient:
        with self._lock:
            client = self._client
            transport = client.get_transport() if client is not None else None
            # A copy of the block (model_copy) with other settings must not reuse this connection.
            wanted = (self.host, self.port, self.user, self.private_key, self.known_hosts)
            if client is None or transport is None or not transport.is_active() or self._client_for != wanted:
                self.close()
                self._client = self._connect()
                self._client_for = wanted
            assert self._client is not None
            return self._client

    def _sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            client = self._ssh()
            if self._sftp_client is None or self._sftp_client.get_channel() is None or \
                    self._sftp_client.get_channel().get_transport() is not client.get_transport():  # fmt: skip
                self._sftp_client = client.open_sftp()
            return self._sftp_client

    def close(self) -> None:
        """Close the SSH connection (the next command opens a new one)."""
        with self._lock:
            if self._client_for != (self.host, self.port, self.user, self.private_key, self.known_hosts):
                # A copy's inherited connection belongs to the original block: forget it, don't close it.
                self._sftp_client = self._client = None
                return
            for closable in (self._sftp_client, self._client):
                try:
                    if closable is not None:
                        closable.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
            self._sftp_client = None
            self._client = None

    # ---- commands --------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, check: bool = True, retry: bool = True,
            timeout: float | None = None, stdin: bytes | None = None) -> tuple[int, str, str]:  # fmt: skip
        """Run ``argv`` on the login node: (exit code, stdout, stderr).

        ``retry``: when the SSH connection turns out to be dead, reconnect and run it once more
        (only for commands that are safe to repeat; sbatch is not). ``stdin``: bytes fed to the command.
        """
        argv = list(argv)
        if self.slurm_conf:
            argv = ["env", f"SLURM_CONF={self.slurm_conf}", *argv]
        timeout = timeout or self.command_timeout
        if self.local:
            try:
                proc = subprocess.run(argv, capture_output=True, input=stdin or b"", timeout=timeout, check=False)
            except FileNotFoundError as exc:
                raise ConfigurationError(f"{argv[0]} is not installed on this machine (local=True): {exc}") from exc
            except subprocess.TimeoutExpired as exc:
                raise TransientError(f"{shlex.join(argv)} did not answer within {timeout:.0f} s") from exc
            rc, out, err = proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
        else:
            for attempt in (1, 2):
                try:
                    rc, out, err = self._exec(shlex.join(argv), timeout, stdin)
                    break
                except (OSError, EOFError, paramiko.SSHException) as exc:
                    self.close()
                    if attempt == 2 or not retry:
                        raise TransientError(f"SSH connection to {self.host}:{self.port} failed running "
                                             f"{_command_name(argv)}: {exc}") from exc  # fmt: skip
        if check and rc != 0:
            self._raise_for(argv, rc, err or out)
        return rc, out, err

    def _exec(self, command: str, timeout: float, stdin: bytes | None = None) -> tuple[int, str, str]:
        transport = self._ssh().get_transport()
        if transport is None:
            raise EOFError("no SSH transport")
        chan = transport.open_session(timeout=self.connect_timeout)
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                progressed = False
                while chan.recv_ready():
                    out += chan.recv(1 << 16)
                    progressed = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                    progressed = True
                # Done at EOF *and* exit status: sshd may send the status while output is still queued.
                if chan.eof_received and chan.exit_status_ready() and not progressed:
                    break
                if chan.closed and not progressed and not chan.exit_status_ready():
                    raise EOFError("the SSH channel closed before the command's exit status arrived")
                if time.monotonic() > deadline:
                    raise socket.timeout(f"no exit status within {timeout:.0f} s")
                if not progressed:
                    select.select([chan], [], [], 0.05)
            # Drain what arrived together with the exit status.
            while chan.recv_ready():
                out += chan.recv(1 << 16)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(1 << 16)
            return chan.recv_exit_status(), out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        finally:
            chan.close()

    def _raise_for(self, argv: Sequence[str], rc: int, message: str) -> None:
        text = message.strip()
        name = _command_name(argv)
        transient_marks = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
                           "Zero Bytes were transmitted", "slurm_persist_conn_open", "Connection timed out",
                           "temporarily unavailable", "try again", "Resource temporarily unavailable")  # fmt: skip
        if any(mark.lower() in text.lower() for mark in transient_marks):
            raise TransientError(f"{name} failed (exit {rc}): {text}")
        raise ConfigurationError(f"{name} failed (exit {rc}): {text}")

    # ---- files on the cluster --------------------------------------------------------------

    def _put_files(self, workdir: str, files: Mapping[str, tuple[bytes, int]], *, keep_existing: bool = False,
                   then: Sequence[str] = (), check: bool = True, retry: bool = True) -> tuple[int, str, str]:  # fmt: skip
        """Write ``files`` (name relative to ``workdir`` -> (data, mode)) in ONE command: a tar sent on
        stdin, unpacked at the filesystem root (so ``workdir`` and the folders in it are created too).
        ``keep_existing``: leave a file that is already there as it is (a retried write of the same data).
        ``then``: a command run once the files are there, in the same SSH command (every command costs
        the login shell's start-up); its exit code and output are returned, and ``check`` and ``retry``
        are as for ``run``.
        """
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, (data, mode) in files.items():
                info = tarfile.TarInfo(posixpath.join(workdir, name).lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        argv = ["tar", "-x", "--no-same-owner", "-C", "/", "-f", "-"]
        if keep_existing:
            argv.insert(2, "--skip-old-files")
        if not then:
            return self.run(argv, stdin=archive.getvalue(), check=check, retry=retry)
        # The command's words reach it as "$@" (never through the shell's parser).
        rc, out, err = self.run(["sh", "-c", f'{shlex.join(argv)} || exit; exec "$@"', "sh", *then],
                                stdin=archive.getvalue(), check=False, retry=retry)  # fmt: skip
        if check and rc != 0:
            self._raise_for(then, rc, err or out)
        return rc, out, err

    def _mkdir(self, path: str) -> None:
        self.run(["mkdir", "-p", "--", path])

    def _write(self, path: str, data: bytes, mode: int) -> None:
        if self.local:
            p = Path(path)
            tmp = p.with_name(p.name + ".tmp")
            tmp.touch(mode=mode)
            tmp.chmod(mode)
            tmp.write_bytes(data)
            tmp.replace(p)
            return
        sftp = self._sftp()
        tmp = path + ".tmp"
        with sftp.open(tmp, "wb") as f:
            f.chmod(mode)  # before any byte is written: secrets are never readable by others
            f.write(data)
        sftp.posix_rename(tmp, path)

    def _read(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes | None:
        try:
            if self.local:
                with open(path, "rb") as f:
                    f.seek(offset)
                    return f.read(limit)
            for attempt in (1, 2):
                try:
                    with self._sftp().open(path, "rb") as f:
                        f.seek(offset)
                        return f.read(limit)
                except (EOFError, paramiko.SSHException, OSError) as exc:
                    if isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == 2:
                        raise
                    self.close()
                    if attempt == 2:
                        raise TransientError(f"reading {path} over SFTP failed: {exc}") from exc
        except FileNotFoundError:
            return None
        return None

    def _size(self, path: str) -> int:
        try:
            if self.local:
                return Path(path).stat().st_size
            return int(self._sftp().stat(path).st_size or 0)
        except (FileNotFoundError, OSError):
            return 0

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
        if job.secrets:
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

    def write_private(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` on the cluster, mode 0600 before a byte is written (its directory created)."""
        self._mkdir(posixpath.dirname(path))
        self._write(path, data, 0o600)

    def _secret_env(self, job: TrainingJob) -> dict[str, SecretStr]:
        return {name: SecretStr(value) for name, value in secret_values(job.secrets).items()}

    # ---- running inside the job's image ----------------------------------------------------------

    def job_container_runtime(self) -> str:
        """The runtime jobs with an image use: ``container_runtime``, or for "auto" what the login node has
        (asked once per cluster): pyxis when ``srun --help`` lists ``--container-image``, else podman, else
        apptainer."""
        if self.container_runtime != "auto":
            return self.container_runtime
        where = self._cluster_key
        with self._lock:
            if self._detected_runtime is not None and self._detected_runtime[0] == where:
                return self._detected_runtime[1]
            _, out, err = self.run(["srun", "--help"], check=False)
            if "--container-image" in out + err:
                found = "pyxis"
            else:
                _, out, _ = self.run(["sh", "-c", "command -v podman; command -v apptainer; true"], check=False)
                names = {posixpath.basename(line.strip()) for line in out.splitlines()}
                found = next((r for r in ("podman", "apptainer") if r in names), "")
            if not found:
                raise ConfigurationError(
                    "the job has an image but the cluster has no container runtime: `srun --help` lists no "
                    "--container-image (pyxis) and neither podman nor apptainer is on the login node's PATH. "
                    f"Install one on the nodes, or set container_runtime to one of {', '.join(CONTAINER_RUNTIMES)}"
                )
            self._detected_runtime = (where, found)
            return found

    def _container_for_job(self, job: TrainingJob) -> Container | None:
        if job.image is None or not job.image.reference:
            return None
        runtime = self.job_container_runtime()
        auth = None
        if self.registry_credentials is not None:
            auth = posixpath.join(job.workdir, ENROOT_CREDENTIALS_NAME if runtime == "pyxis" else REGISTRY_AUTH_NAME)
        return Container(
            image=check_pinned_image(job.image.reference, "job.image.reference"), runtime=runtime,  # type: ignore[arg-type]
            mounts=tuple(self.container_mounts), auth_file=auth, runtime_env=dict(self.container_runtime_env),
            env_names=tuple(sorted(job.secrets)), workdir=job.image.workdir,
            gpu_mode=self.podman_gpu_mode, podman_options=tuple(self.podman_options),
        )  # fmt: skip

    def _container_files(self, job: TrainingJob) -> dict[str, bytes]:
        """The registry login for the job's pull, in the runtime's format: sent with mode 0600, never in the script."""
        creds = self.registry_credentials
        if self._container_for_job(job) is None or creds is None:
            return {}
        _, registry = _registry_parts(creds.registry_url)
        user, password = creds.username, creds.password.get_secret_value()
        if self.job_container_runtime() == "pyxis":
            if any(c.isspace() for c in user + password):
                raise ConfigurationError(
                    "registry_credentials: enroot's .credentials (netrc) cannot hold a username or password with "
                    "whitespace; use a registry token without spaces"
                )
            line = f"machine {registry.split(':')[0]} login {user} password {password}\n"
            return {ENROOT_CREDENTIALS_NAME: line.encode()}
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {REGISTRY_AUTH_NAME: json.dumps({"auths": {registry: {"auth": token}}}).encode()}

    def submit(self, job: TrainingJob) -> JobHandle:
        self.validate_job(job)
        self.ship_code(job)
        return self._submit(job.key, job.workdir, self._script_for_job(job), array=False,
                            secret_env=self._secret_env(job), secret_files=self._container_files(job))  # fmt: skip

    # ---- sweeps: one job array, one environment per task ------------------------------------------

    @staticmethod
    def task_dir(workdir: str, index: int) -> str:
        """The directory array task ``index`` of a sweep owns (its checkpoints and progress)."""
        return posixpath.join(workdir, f"task-{index}")

    def submit_sweep(self, job: TrainingJob, tasks: Sequence[Mapping[str, str]], *,
                     parallelism: int | None = None) -> JobHandle:  # fmt: skip
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
        return self._submit(job.key, job.workdir, script, array=True, hold=True,
                            secret_env=self._secret_env(job), secret_files=self._container_files(job))  # fmt: skip

    def release_sweep_tasks(self, handle: JobHandle, tasks: Mapping[int, Mapping[str, str]], *,
                            whole_array: bool = False) -> None:  # fmt: skip
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
        target = handle.job_id if whole_array else f"{handle.job_id}_[{_index_ranges(entries)}]"
        argv = ["scontrol", "release", target]
        files = {f"{TASKS_DIR}/{index}.env": ("".join(f"{name}={value}\0" for name, value in entry.items()).encode(), 0o644)
                 for index, entry in entries.items()}  # fmt: skip
        if files:  # the settings, then the release: one command
            rc, out, err = self._put_files(handle.workdir, files, keep_existing=True, then=argv, check=False)
        else:
            rc, out, err = self.run(argv, check=False)
        problems = [line for line in (err + out).splitlines()
                    if line.strip() and not line.rstrip().endswith(("Job has already finished", "No error"))]  # fmt: skip
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
            }  # fmt: skip
        return entries

    def array_outcome(self, handle: JobHandle, size: int, *,
                      wait_seconds: float = 60.0) -> dict[int, tuple[JobStatus, dict[str, float]]]:  # fmt: skip
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
        ended = sum(1 for r in records if str(r.get("array_job_id") or "") == handle.job_id
                    and r.get("array_task_id") is not None and self._from_squeue(r).terminal)  # fmt: skip
        if time.monotonic() - fetched > 30 or ended < size:
            records = self._squeue([handle.job_id])
        for record in records:
            if str(record.get("array_job_id") or "") != handle.job_id or record.get("array_task_id") is None:
                continue
            status = self._from_squeue(record)
            if status.terminal and not record.get("restart_cnt"):
                elapsed = max(0, int(record.get("end_time") or 0) - int(record.get("start_time") or 0))
                row = [status.job_id, status.job_id, str(record.get("job_state")), str(elapsed),
                       str(record.get("tres_alloc_str") or ""), str(record.get("cpus") or 0)]  # fmt: skip
                found[int(record["array_task_id"])] = (status, self._usage([row]))
        rest = [i for i in range(size) if i not in found]
        deadline = time.monotonic() + wait_seconds
        while rest:
            _, out, _ = self.run([
                "sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id,
                "--format=JobIDRaw,JobID,State,ElapsedRaw,AllocTRES,NCPUS,ExitCode,Reason",
            ])  # fmt: skip
            per_task: dict[int, list[list[str]]] = {}
            for line in out.splitlines():
                row = line.split("|")
                if len(row) >= 8 and "_" in row[1] and row[1].split("_", 1)[1].isdigit():
                    per_task.setdefault(int(row[1].split("_", 1)[1]), []).append(row)
            for index in list(rest):
                rows = per_task.get(index, [])
                last = rows[-1] if rows else None  # sacct lists the attempts in order
                if last is None:
                    continue
                exit_code = _sacct_exit(last[6])
                state, why = map_state(last[2], requeue=False, exit_code=exit_code,
                                       reason="" if last[7] in ("", "None") else f"Slurm reason: {last[7]}")  # fmt: skip
                if state in TERMINAL_STATES:
                    found[index] = (JobStatus(job_id=last[1], state=state, exit_code=exit_code, reason=why,  # type: ignore[arg-type]
                                              elapsed_seconds=float(last[3] or 0)), self._usage(rows))  # fmt: skip
                    rest.remove(index)
            if not rest or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        missing = JobStatus(job_id=handle.job_id, state="FAILED", reason="no final state recorded for this array task")
        return {i: found.get(i, (missing.model_copy(update={"job_id": f"{handle.job_id}_{i}"}), self._usage([])))
                for i in range(size)}  # fmt: skip

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

    # One squeue record: ``squeue -O`` field, and the name the record gets (``squeue --json``'s).
    _SQUEUE_FIELDS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("JobID", "job_id"), ("ArrayJobID", "array_job_id"), ("ArrayTaskID", "array_task_id"),
        ("State", "job_state"), ("exit_code", "exit_code"), ("Reason", "state_reason"), ("Requeue", "requeue"),
        ("RestartCnt", "restart_cnt"), ("StartTime", "start_time"), ("EndTime", "end_time"), ("NumCPUs", "cpus"),
        ("tres-alloc", "tres_alloc_str"),
    )  # fmt: skip

    def _squeue(self, job_ids: Iterable[str] = ()) -> list[dict[str, Any]]:
        """The controller's records of ``job_ids`` (of every job it holds when none are given).

        ONE ``squeue`` in text form, ``-O`` fields separated by ``|`` and times as epoch seconds: two
        RPCs (the jobs, the partitions) whether it asks for one job or for a thousand (``--local``: no
        federation lookup, which squeue adds for a single id). squeue filters by ``-j`` itself, whereas
        ``squeue --json`` in 22.05 ignores ``-j`` and serialises every job in the controller's memory
        (~10 MB and up to a second at 2,000 records).
        Pending array tasks come as one record whose ``array_task_id`` is None.
        """
        ids = sorted({str(j) for j in job_ids}, key=int)
        argv = ["env", "SLURM_TIME_FORMAT=%s", "squeue", "--local", "-h", "-t", "all",
                "-O", ",".join(f"{field}:|" for field, _ in self._SQUEUE_FIELDS)]  # fmt: skip
        if ids:
            argv += ["-j", ",".join(ids)]
        rc, out, err = self.run(argv, check=False)
        if rc != 0:
            # squeue looks a single id up on its own, and one the controller has forgotten is an error.
            if not (len(ids) == 1 and "Invalid job id" in err):
                self._raise_for(argv, rc, err or out)
            out = ""
        jobs = []
        for line in out.splitlines():
            values = line.split("|")
            if len(values) < len(self._SQUEUE_FIELDS) or not values[0].strip().isdigit():
                continue
            record: dict[str, Any] = {name: value.strip() for (_, name), value in zip(self._SQUEUE_FIELDS, values)}
            for name in ("job_id", "array_job_id", "exit_code", "restart_cnt", "start_time", "end_time", "cpus"):
                record[name] = int(record[name]) if record[name].isdigit() else 0
            task = record["array_task_id"]
            record["array_task_id"] = int(task) if task.isdigit() else None
            record["requeue"] = record["requeue"] == "1"
            jobs.append(record)
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
            statuses[job_id] = self._aggregate(job_id, [self._from_squeue(r) for r in records[job_id]])
        if missing:
            statuses.update(self._from_sacct(missing))
        return {h.job_id: statuses[h.job_id] for h in handles}

    @staticmethod
    def _from_squeue(record: dict[str, Any]) -> JobStatus:
        exit_code = _wait_status_to_exit(record.get("exit_code"))
        slurm_state = str(record.get("job_state", "PENDING"))
        state, reason = map_state(slurm_state, requeue=bool(record.get("requeue")), exit_code=exit_code,
                                  reason="" if record.get("state_reason") in (None, "None") else
                                  f"Slurm reason: {record.get('state_reason')}")  # fmt: skip
        if state in ("RUNNING", "PENDING") and record.get("restart_cnt"):
            reason = f"attempt {int(record['restart_cnt']) + 1} (requeued {record['restart_cnt']}x). {reason}".strip()
        start, end = record.get("start_time") or 0, record.get("end_time") or 0
        now = time.time()
        elapsed = max(0.0, (end if state not in ("PENDING", "RUNNING") and end else now) - start) if start else 0.0
        task = record.get("array_task_id")
        job_id = str(record["job_id"]) if task is None else f"{record.get('array_job_id')}_{task}"
        return JobStatus(job_id=job_id, state=state, exit_code=exit_code if state != "RUNNING" else None,
                         reason=reason, elapsed_seconds=elapsed if state != "PENDING" else 0.0)  # fmt: skip

    def _from_sacct(self, job_ids: list[str]) -> dict[str, JobStatus]:
        _, out, _ = self.run([
            "sacct", "-X", "-n", "-P", "-j", ",".join(sorted(job_ids, key=int)),
            "--format=JobIDRaw,JobID,State,ExitCode,ElapsedRaw,Reason",
        ])  # fmt: skip
        per_job: dict[str, list[JobStatus]] = {j: [] for j in job_ids}
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) < 6:
                continue
            _raw, jid, slurm_state, exit_text, elapsed, reason = parts[:6]
            base = jid.split("_")[0]
            if base not in per_job:
                continue
            exit_code = _sacct_exit(exit_text)
            # A job sacct reports PREEMPTED/NODE_FAIL that the controller no longer has was not requeued.
            state, why = map_state(slurm_state, requeue=False, exit_code=exit_code,
                                   reason="" if reason in ("", "None") else f"Slurm reason: {reason}")  # fmt: skip
            per_job[base].append(JobStatus(job_id=jid, state=state, exit_code=exit_code, reason=why,
                                           elapsed_seconds=float(elapsed or 0)))  # fmt: skip
        result = {}
        for job_id, items in per_job.items():
            if items:
                result[job_id] = self._aggregate(job_id, items)
            else:  # not in the controller's memory and not (yet) in the accounting database
                result[job_id] = JobStatus(job_id=job_id, state="PENDING",
                                           reason="not visible in squeue or sacct yet (sacct lags the controller)")  # fmt: skip
        return result

    @staticmethod
    def _aggregate(job_id: str, items: list[JobStatus]) -> JobStatus:
        """One status for a job (one item) or an array (one item per task or pending group)."""
        if len(items) == 1:
            return items[0].model_copy(update={"job_id": job_id})
        elapsed = max(i.elapsed_seconds for i in items)
        live = [i for i in items if not i.terminal]
        if live:
            order = ("PREEMPTED", "REQUEUED", "RUNNING", "PENDING")
            state = next(s for s in order if any(i.state == s for i in live))
            done = sum(1 for i in items if i.terminal)
            return JobStatus(job_id=job_id, state=state, elapsed_seconds=elapsed,  # type: ignore[arg-type]
                             reason=f"array: {done} tasks finished, {len(live)} records still queued or running")
        failed = [i for i in items if i.state != "COMPLETED"]
        if not failed:
            return JobStatus(job_id=job_id, state="COMPLETED", exit_code=0, elapsed_seconds=elapsed,
                             reason=f"array: all {len(items)} tasks completed")  # fmt: skip
        first = sorted(failed, key=lambda i: i.job_id)[0]
        return JobStatus(job_id=job_id, state=first.state, exit_code=first.exit_code, elapsed_seconds=elapsed,
                         reason=f"array: {len(failed)} of {len(items)} tasks did not complete; task {first.job_id}: "
                                f"{first.reason}")  # fmt: skip

    def _first_failed_task(self, handle: JobHandle) -> str | None:
        status = self.poll([handle])[handle.job_id]
        for word in status.reason.split():
            if word.startswith(f"{handle.job_id}_"):
                return word.split("_", 1)[1].rstrip(":")
        return None

    def cancel(self, handle: JobHandle) -> None:
        self.run(["scancel", handle.job_id])
        self.remove_job_secrets(handle)

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
        deadline = time.monotonic() + wait_seconds
        while True:
            _, out, _ = self.run([
                "sacct", "-X", "-D", "-n", "-P", "-j", handle.job_id,
                "--format=JobIDRaw,JobID,State,ElapsedRaw,AllocTRES,NCPUS",
            ])  # fmt: skip
            rows = [line.split("|") for line in out.splitlines() if line.count("|") >= 5]
            settled = rows and all(r[2].split()[0] in self._TERMINAL_SLURM or r[2].startswith("REQUEUED")
                                   for r in rows)  # fmt: skip
            if settled or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        return self._usage(rows)

    @staticmethod
    def _usage(rows: list[list[str]]) -> dict[str, float]:
        gpu_s = cpu_s = wall = 0.0
        requeues = 0
        for _raw, _jid, state, elapsed_text, tres, ncpus in (r[:6] for r in rows):
            elapsed = float(elapsed_text or 0)
            gpus = 0
            for item in tres.split(","):
                name, _, value = item.partition("=")
                if name == "gres/gpu" and value.isdigit():
                    gpus = int(value)
            gpu_s += gpus * elapsed
            cpu_s += int(ncpus or 0) * elapsed
            wall = max(wall, elapsed)
            if state.split()[0] in ("PREEMPTED", "REQUEUED", "NODE_FAIL"):
                requeues += 1
        return {"gpu_hours": gpu_s / 3600, "cpu_hours": cpu_s / 3600, "wall_seconds": wall, "requeues": requeues}

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
