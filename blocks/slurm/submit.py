"""Submit and adopt on Slurm: the workload's code shipped once per content, the job's secrets and script sent,
``sbatch`` run, and a job that already carries the key adopted instead of a second one made.

``SlurmSubmit`` is a mixin of ``SlurmCluster``: it uses the block's commands and files (``run``, ``_mkdir``,
``_write``, ``_put_files``, ``_raise_for``: ``blocks/slurm/transport.py``), its validation and batch script
(``validate_job``, ``_script_for_job``, ``_common_options``, ``_check_partition``, ``_workdir_ok``), its
container login files (``_container_files``) and its fields ``code_root``, ``workdir_root`` and
``adopt_lookback_days``; it keeps what it shipped in the private ``_shipped_code`` under ``_lock``.

* ``submit(job)`` is idempotent: the job key is the Slurm job name and is also in its comment
  (``gpuferry-key:<key>``). Before ``sbatch`` it looks for a live job (``squeue``) or a finished one
  (``sacct``) carrying the key — one command, read by ``blocks/slurm/state.py`` — and adopts it, so a
  retried submit never makes a second job. If the connection drops *during* sbatch the error is
  transient: the retry finds the job by its key.
* Secrets never go into the batch script: they go to a 0600 file next to it over SFTP, which the script
  sources.
"""

from __future__ import annotations

import math
import posixpath
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from blocks.base.log import run_logger
from blocks.base.secrets import job_secret_values
from blocks.errors import ConfigurationError, TransientError
from blocks.records import CodeRef, JobHandle, TrainingJob
from blocks.slurm.script import check_name, sbatch_script
from blocks.slurm.state import JOBS_NAMED_SH, KEY_COMMENT_PREFIX, job_for_key, sbatch_job_id, split_jobs_named

SCRIPT_NAME = "job.sbatch"
# How long a process trusts that code it shipped is still there before it looks (and marks it used) again: far
# below the ages `gpuferry gc` frees code at, so a long-running worker never submits into a directory gc freed.
CODE_RECHECK_S = 600.0
SECRETS_NAME = ".secret.env"

# Unpack the archive on stdin into "$1" unless it is there: checked against its sha256 ("$2") first, unpacked
# beside the target and renamed into place, so a directory that exists is complete.
UNPACK_SH = (
    'set -e; [ -f "$1/.complete" ] && exit 0; mkdir -p "$(dirname "$1")"; tmp="$1.tmp.$$"; '
    'rm -rf "$tmp"; mkdir "$tmp"; cat > "$tmp.tar.gz"; '
    'echo "$2  $tmp.tar.gz" | sha256sum -c --status || { rm -rf "$tmp" "$tmp.tar.gz"; '
    'echo "the code archive arrived damaged (sha256 mismatch)" >&2; exit 3; }; '
    'tar -xzf "$tmp.tar.gz" -C "$tmp"; rm -f "$tmp.tar.gz"; touch "$tmp/.complete"; '
    'mv -T "$tmp" "$1" 2>/dev/null || { [ -f "$1/.complete" ] && rm -rf "$tmp"; }'
)


if TYPE_CHECKING:
    from blocks.slurm.host import SlurmHost
else:
    SlurmHost = object  # the type checker's view of the block (blocks/slurm/host.py); a plain mixin here


class SlurmSubmit(SlurmHost):
    """The submit side of a ``SlurmCluster`` (see the module's docstring)."""

    # ---- the workload's code, shipped once per content ------------------------------------------

    def code_dir(self, sha256: str) -> str:
        """Where the code with archive hash ``sha256`` is unpacked on the cluster."""
        root = self.code_root or posixpath.join(self.workdir_root or posixpath.dirname(self.job_workdir("x")), ".code")
        return posixpath.join(root, sha256[:24])

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
            shipped = self._shipped_code.get(self._cluster_key, {})
            if time.monotonic() - shipped.get(target, -math.inf) < CODE_RECHECK_S:
                return target
        # There already: marked used now (its last write is what `gpuferry gc` ages it by).
        rc, _, _ = self.run(
            ["sh", "-c", 'test -f "$1" && exec touch -c -- "$1"', "sh", f"{target}/.complete"], check=False
        )
        if rc != 0:
            data = Path(code.archive).read_bytes()
            self.run(["sh", "-c", UNPACK_SH, "sh", target, code.sha256], stdin=data)
            run_logger().info(
                "shipped %s (%d files, %d bytes, sha256 %s) to %s",
                what,
                code.files,
                code.size_bytes,
                code.sha256[:12],
                target,
            )
        with self._lock:
            self._shipped_code.setdefault(self._cluster_key, {})[target] = time.monotonic()
        return target

    # ---- submit and adopt: the job key is the job's name (and in its comment) ----------------------------

    def _secret_env(self, job: TrainingJob) -> dict[str, SecretStr]:
        return {name: SecretStr(value) for name, value in job_secret_values(job).items()}

    def submit(self, job: TrainingJob) -> JobHandle:
        self.validate_job(job)
        self.ship_code(job)
        return self._submit(
            job.key,
            job.workdir,
            self._script_for_job(job),
            array=False,
            secret_env=self._secret_env(job),
            secret_files=self._container_files(job),
        )

    def submit_command(
        self,
        key: str,
        command: Sequence[str],
        *,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        secret_env: Mapping[str, SecretStr] | None = None,
        **sbatch_options: Any,
    ) -> JobHandle:
        """Submit ``command`` (an argv list) as a batch job — or, with ``array=``, as a job array.

        Idempotent like ``submit``. ``sbatch_options`` are those of ``blocks.slurm.script.sbatch_script``
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

    def _submit(
        self,
        key: str,
        workdir: str,
        script: str,
        *,
        array: bool,
        hold: bool = False,
        secret_env: Mapping[str, SecretStr] | None = None,
        secret_files: Mapping[str, bytes] | None = None,
    ) -> JobHandle:
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
            raise TransientError(
                f"{exc} — the job may have been submitted; a retried submit adopts it by its key"
            ) from exc
        return self._handle(sbatch_job_id(out), key, workdir, log)

    def _handle(self, job_id: str, key: str, workdir: str, log: str) -> JobHandle:
        return JobHandle(backend=self.backend_name, job_id=job_id, key=key, workdir=workdir, log_path=log)

    def find_job(self, key: str) -> str | None:
        """The id of a live or finished job carrying ``key`` (live ones first), or None."""
        live, accounted = self._jobs_named(key)
        return job_for_key(key, live, accounted)

    def _jobs_named(self, name: str) -> tuple[list[str], list[str]]:
        """The jobs named ``name``, asked in ONE command (each costs the login shell's start-up):
        the controller's in every state (a job that just finished is in its memory before sacct has
        it) as ``array job id|name|comment`` lines (text squeue filters by name; ``squeue --json``
        would return every job in memory), then the accounting database's of the last
        ``adopt_lookback_days`` as ``JobIDRaw|JobID|Comment`` lines."""
        argv = ["sh", "-c", JOBS_NAMED_SH, "sh", name, f"now-{self.adopt_lookback_days}days"]
        rc, out, err = self.run(argv, check=False)
        live, accounted = split_jobs_named(out)
        if rc != 0:
            self._raise_for(["sacct" if accounted is not None else "squeue", f"--name={name}"], rc, err or out)
        return live, accounted or []
