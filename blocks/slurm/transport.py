"""How ``SlurmCluster`` reaches the login node: one verified SSH connection, commands as argv lists, files.

The connection is opened on first use with the host key checked against the block's ``known_hosts`` (an
unknown or changed key is refused, never added), reused by every command and re-opened when it drops;
with ``local=True`` the commands run on this machine instead (the flow runs on the login node). Every
command is an argv list joined with ``shlex.quote``: no user value is ever formatted into a shell string.

Files go in one ``tar`` on the command's stdin (many at once) or over SFTP (secrets: created 0600 before a
byte is written).

What a job's environment starts from: sbatch exports the environment it runs in to the job (``--export=ALL``,
Slurm's default, which the batch script and ``srun`` inside it rely on). Over SSH that is the login session's
on the cluster (the user's login environment there: nothing of this process crosses SSH). With ``local=True``
the commands get only ``INHERITED_ENV`` (``blocks/local/compute.py``), ``SLURM_CONF`` and the block's ``pass_env``,
never the rest of the orchestrator's environment (Prefect's API key, cloud credentials). Other ``SLURM_*`` and
``SBATCH_*`` variables are not passed either: they would set options behind the block's back, or describe an
allocation the orchestrator itself runs in. The script then adds the contract's variables, the workload's
own and its secrets (a 0600 file it sources).

``SlurmTransport`` is a mixin of ``SlurmCluster``: it reads the block's connection fields (``local``,
``host``, ``port``, ``credentials``, ``connect_timeout``, ``command_timeout``, ``slurm_conf``, ``pass_env``)
and keeps its ``SshSession`` (``blocks/ssh/session.py``, the one SSH session of every block) in its private
attributes (``_lock``, ``_session``, ``_session_for``).
"""

from __future__ import annotations

import io
import posixpath
import shlex
import subprocess
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paramiko

from blocks.base.compute import inherited_environment
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.slurm.state import command_error, command_name
from blocks.ssh.session import TRANSPORT_ERRORS, SshSession

if TYPE_CHECKING:
    from blocks.ssh.credentials import SshCredentials


class SlurmTransport:
    """Commands and files on the login node (see the module's docstring)."""

    if TYPE_CHECKING:
        local: bool
        host: str | None
        port: int
        credentials: SshCredentials | None
        connect_timeout: float
        command_timeout: float
        slurm_conf: str | None
        pass_env: list[str]
        _lock: Any
        _session: SshSession | None
        _session_for: tuple[Any, ...] | None

    # ---- connection ------------------------------------------------------------------------

    @property
    def user(self) -> str | None:
        """The SSH user on the login node (``credentials.user``): the Slurm user the jobs run as."""
        return self.credentials.user if self.credentials is not None else None

    @property
    def _connection_key(self) -> tuple[Any, ...]:
        return (self.host, self.port, self.credentials.identity if self.credentials is not None else None)

    def _new_session(self) -> SshSession:
        if (
            not self.host
            or self.credentials is None
            or not self.credentials.user
            or self.credentials.private_key is None
        ):
            raise ConfigurationError(
                "host and credentials (user, private_key, known_hosts) are required unless local=True"
            )
        return SshSession(
            self.credentials,
            self.host,
            self.port,
            connect_timeout=self.connect_timeout,
            command_timeout=self.command_timeout,
            name=f"{self.host}:{self.port}",
            check_against="matches the one the cluster's admins publish",
        )

    def _ssh(self) -> SshSession:
        """The session to the login node; a copy of the block (model_copy) with other settings gets its own."""
        with self._lock:
            if self._session is None or self._session_for != self._connection_key:
                # (a copy's inherited session belongs to the original block: replaced here, not closed)
                self._session = self._new_session()
                self._session_for = self._connection_key
            return self._session

    def _connected(self) -> SshSession:
        """The session, connected; a failed connection is a ``TransientError`` naming the login node."""
        session = self._ssh()
        try:
            session.client()
        except GpuferryError:
            raise
        except TRANSPORT_ERRORS as exc:
            raise TransientError(f"cannot reach the login node {self.host}:{self.port}: {exc}") from exc
        return session

    def _sftp(self) -> paramiko.SFTPClient:
        return self._connected().sftp()

    def close(self) -> None:
        """Close the SSH connection (the next command opens a new one)."""
        with self._lock:
            if self._session is not None and self._session_for == self._connection_key:
                self._session.close()
            else:  # a copy's inherited session belongs to the original block: forget it, don't close it
                self._session = None

    # ---- commands --------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        retry: bool = True,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> tuple[int, str, str]:
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
                proc = subprocess.run(
                    argv,
                    capture_output=True,
                    input=stdin or b"",
                    timeout=timeout,
                    check=False,
                    env=inherited_environment(("SLURM_CONF", *self.pass_env)),
                )
            except FileNotFoundError as exc:
                raise ConfigurationError(f"{argv[0]} is not installed on this machine (local=True): {exc}") from exc
            except subprocess.TimeoutExpired as exc:
                raise TransientError(f"{shlex.join(argv)} did not answer within {timeout:.0f} s") from exc
            rc, out, err = (
                proc.returncode,
                proc.stdout.decode("utf-8", "replace"),
                proc.stderr.decode("utf-8", "replace"),
            )
        else:
            # Once more on a fresh connection when the session dropped: a reconnect, not a retry policy (the
            # task that called owns that, tasks/retry.py), so not tenacity.
            for attempt in (1, 2):
                try:
                    rc, out, err = self._exec(shlex.join(argv), timeout, stdin)
                    break
                except TRANSPORT_ERRORS as exc:
                    self.close()
                    if attempt == 2 or not retry:
                        raise TransientError(
                            f"SSH connection to {self.host}:{self.port} failed running {command_name(argv)}: {exc}"
                        ) from exc
        if check and rc != 0:
            self._raise_for(argv, rc, err or out)
        return rc, out, err

    def _exec(self, command: str, timeout: float, stdin: bytes | None = None) -> tuple[int, str, str]:
        return self._connected().run(command, timeout=timeout, stdin=stdin)

    def _raise_for(self, argv: Sequence[str], rc: int, message: str) -> None:
        raise command_error(argv, rc, message)

    # ---- files on the cluster --------------------------------------------------------------

    def _put_files(
        self,
        workdir: str,
        files: Mapping[str, tuple[bytes, int]],
        *,
        keep_existing: bool = False,
        then: Sequence[str] = (),
        check: bool = True,
        retry: bool = True,
    ) -> tuple[int, str, str]:
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
        rc, out, err = self.run(
            ["sh", "-c", f'{shlex.join(argv)} || exit; exec "$@"', "sh", *then],
            stdin=archive.getvalue(),
            check=False,
            retry=retry,
        )
        if check and rc != 0:
            self._raise_for(then, rc, err or out)
        return rc, out, err

    def _mkdir(self, path: str) -> None:
        self.run(["mkdir", "-p", "--", path])

    def _write(self, path: str, data: bytes, mode: int) -> None:
        if self.local:
            p = Path(path)
            local_tmp = p.with_name(p.name + ".tmp")
            local_tmp.touch(mode=mode)
            local_tmp.chmod(mode)
            local_tmp.write_bytes(data)
            local_tmp.replace(p)
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
            for attempt in (1, 2):  # once more on a fresh connection, as run() does
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
