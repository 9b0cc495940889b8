"""What ``gpuferry gc`` may free on a Slurm cluster, found and freed over the block's own connection.

* **Job directories** under the job root (``workdir_root``; a job's or a sweep array's directory is named by its
  key, the job's Slurm name) that no job still in the queue (pending, running, suspended, requeued) carries.
* **Code directories** under the code root (``code_root``, or ``.code`` under the job root: the workload's code
  unpacked once per content, and gpuferry's runtime the store step runs) that no queued job runs in (the
  directory its batch script changes to). Shipping code that is there already marks it used (``ship_archive``), so
  a directory's last write is its last use.

Each is listed with its size and last write (the newest file in it) from one command on the login node, so
``housekeeping.garbage`` applies the age limit and keeps what a registered version references, as it does for
the other backends. ``remove_job`` deletes only a directory directly under one of those two roots.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import TYPE_CHECKING

from blocks.errors import ConfigurationError
from blocks.records import Garbage
from blocks.slurm.submit import SCRIPT_NAME

if TYPE_CHECKING:
    from blocks.slurm.host import SlurmHost
else:
    SlurmHost = object  # the type checker's view of the block (blocks/slurm/host.py); a plain mixin here

# "$1" the job root, "$2" the code root: each directory in them as D|size|newest write|path (a glob that matched
# nothing is skipped); then each job of this user in the queue as J|name and, from its batch script, the directory
# it runs in as C|path (as the script quotes it). squeue failing fails the whole: nothing is listed as unused.
LIST_SH = (
    'for d in "$1"/*/ "$2"/*/; do [ -d "$d" ] || continue; d="${d%/}"; '
    's=$(du -sb -- "$d" 2>/dev/null | cut -f1); '
    "m=$(find \"$d\" -printf '%T@\\n' 2>/dev/null | sort -n | tail -n 1); "
    'printf \'D|%s|%s|%s\\n\' "${s:-0}" "${m:-0}" "$d"; done; '
    'q=$(squeue -h -u "$(id -un)" -o "%j") || exit 3; '
    'printf "%s\\n" "$q" | sort -u | while IFS= read -r n; do [ -n "$n" ] || continue; printf "J|%s\\n" "$n"; '
    'case "$n" in */*|.*) continue;; esac; '
    f'sed -n "s/^cd \\(.*\\) || exit 1$/C|\\1/p" "$1/$n/{SCRIPT_NAME}" 2>/dev/null; done'
)


class SlurmHousekeeping(SlurmHost):
    """The ``gpuferry gc`` side of a ``SlurmCluster`` (see the module's docstring)."""

    def _gc_roots(self) -> tuple[str, str]:
        jobs = posixpath.dirname(self.job_workdir("x"))
        code = posixpath.dirname(self.code_dir("x"))
        return posixpath.normpath(jobs), posixpath.normpath(code)

    def ended_jobs(self) -> list[Garbage]:
        """The job directories and code directories on the cluster that nothing in the queue uses."""
        jobs_root, code_root = self._gc_roots()
        _, out, _ = self.run(["sh", "-c", LIST_SH, "sh", jobs_root, code_root])
        lines = out.splitlines()
        names = {line[2:] for line in lines if line.startswith("J|")}
        cwds = {posixpath.normpath(shlex.split(line[2:])[0]) for line in lines if line.startswith("C|")}
        found = []
        for line in lines:
            if not line.startswith("D|"):
                continue
            size, modified, where = line[2:].split("|", 2)
            parent, name = posixpath.split(posixpath.normpath(where))
            if _holds(where, code_root):
                continue  # the code root itself, set inside the job root
            if parent == code_root:
                used = any(_holds(where, cwd) for cwd in cwds)
                kind = "code directory"
            else:
                used = name in names
                kind = "job directory"
            if not used:
                found.append(Garbage(kind=kind, where=where, size_bytes=int(size), modified=float(modified)))
        return found

    def remove_job(self, where: str) -> None:
        """Delete a directory ``ended_jobs`` listed: one directly under the job root or the code root."""
        path = posixpath.normpath(where)
        parent, name = posixpath.split(path)
        roots = self._gc_roots()
        if parent not in roots or name in ("", ".", "..") or _holds(path, roots[1]):
            raise ConfigurationError(f"{where} is not a job or code directory of this cluster")
        self.run(["rm", "-rf", "--", path])


def _holds(directory: str, path: str) -> bool:
    """``path`` is ``directory`` or lies in it."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")
