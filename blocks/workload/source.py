"""Loading a workload: its ``gpuferry.yaml`` from a local path or a git URL, and its code as one archive.

``load_workload(source)`` takes

* a local directory (or its ``gpuferry.yaml``): used in place; when it is inside a git work tree, the
  commit of ``HEAD`` and whether the directory has uncommitted changes are recorded;
* ``git+URL@REF#subdirectory=PATH`` (pip's form; ``@REF`` and the subdirectory are optional; any URL git
  clones: https, ssh, file): the repository is fetched into a cache (``$GPUFERRY_CACHE/git``), ``REF`` is
  resolved to a commit, and that commit's tree is unpacked once under ``$GPUFERRY_CACHE/workloads/<commit>``.

The result, ``Workload``, carries the parsed definition and ``code``: the workload's files as one
content-addressed ``.tar.gz`` (sorted entries, no timestamps or owners, so the same files give the same
sha256). Image-less cluster backends ship that archive once and unpack it on the cluster; its sha256 goes on
the MLflow run. The files are those git would commit (tracked, plus untracked files not ignored) or, outside
git, every file except hidden directories and ``__pycache__``.

git runs with argument lists (no shell) and ``GIT_TERMINAL_PROMPT=0``: a URL that needs a password fails
at once instead of waiting for one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from blocks.config_file import load_yaml
from blocks.errors import ConfigurationError, TransientError
from blocks.home import gpuferry_cache, gpuferry_home
from blocks.records import CodeRef
from blocks.workload.archive import deterministic_tar
from blocks.workload.definition import WORKLOAD_FILE, WorkloadDefinition

_SUBDIR = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.(?:/|$))[A-Za-z0-9_./@+-]{1,255}$")
GIT_TIMEOUT = 600.0


class Workload(BaseModel):
    """A loaded workload: where it came from, which commit, its definition and its code."""

    model_config = ConfigDict(frozen=True)

    source: str = Field(description="As given: a path or git+URL@REF#subdirectory=PATH.")
    root: str = Field(description="The local directory that holds gpuferry.yaml (the commands run from it).")
    commit: str | None = Field(None, description="The git commit of the code (None: not in git).")
    dirty: bool = Field(False, description="The directory had uncommitted changes (a local path in git).")
    definition: WorkloadDefinition

    @property
    def name(self) -> str:
        return self.definition.name

    @cached_property
    def code(self) -> CodeRef:
        """The workload's files as one content-addressed archive (built once per content, cached)."""
        files = None
        if self.source.startswith("git+") and self.commit:
            url, _, sub = parse_git_source(self.source)
            files = commit_files(url, self.commit, sub)
        return code_archive(Path(self.root), files)

    def image_workdir(self) -> str | None:
        """Where the commands run inside the workload's image (see ``WorkloadDefinition.image_workdir``)."""
        image = self.definition.image
        text = None
        if image is not None and image.kind == "dockerfile":
            try:
                text = (Path(self.root) / image.context / (image.dockerfile or "Dockerfile")).read_text()
            except OSError:
                text = None
        return self.definition.image_workdir(text)

    def run_tags(self) -> dict[str, str]:
        """What identifies the code, for the MLflow run."""
        return {
            "gpuferry.workload": self.name,
            "gpuferry.workload.source": self.source,
            "gpuferry.workload.commit": self.commit or "none",
            "gpuferry.workload.dirty": str(self.dirty).lower(),
            "gpuferry.workload.code_sha256": self.code.sha256,
        }


def _git(args: list[str], cwd: Path | None = None, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "LC_ALL": "C"}
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=GIT_TIMEOUT, check=check
        )
    except FileNotFoundError:
        raise ConfigurationError("git is not installed: it is needed to load a workload from a git URL") from None
    except subprocess.TimeoutExpired as exc:
        raise TransientError(f"git {' '.join(args[:2])} took longer than {GIT_TIMEOUT:.0f} s") from exc


def parse_git_source(source: str) -> tuple[str, str | None, str | None]:
    """``(url, ref, subdirectory)`` of ``git+URL@REF#subdirectory=PATH`` (pip's form: the ref follows the last
    ``@`` after the URL's last ``/``, so ``git+ssh://git@host/repo.git`` has none)."""
    rest, _, fragment = source.removeprefix("git+").partition("#")
    slash, at = rest.rfind("/"), rest.rfind("@")
    url, ref = (rest[:at], rest[at + 1 :]) if at > slash >= 0 else (rest, None)
    sub = None
    if fragment:
        key, _, sub = fragment.partition("=")
        if key != "subdirectory" or not sub:
            raise ConfigurationError(f"workload={source!r}: the only fragment understood is #subdirectory=PATH")
        sub = sub.strip("/")
        if not _SUBDIR.match(sub):
            raise ConfigurationError(
                f"workload={source!r}: subdirectory={sub!r} must be a relative path inside the repository"
            )
    if "://" not in url and not url.startswith("/") or not ref and ref is not None:
        raise ConfigurationError(
            f"workload={source!r}: write a git source as git+URL[@REF][#subdirectory=PATH], e.g. "
            "git+https://github.com/team/models.git@main#subdirectory=house-prices"
        )
    return url, ref, sub


def _fetch(url: str, ref: str | None) -> str:
    """The commit ``ref`` names in ``url`` (fetched into the cache's mirror of the repository)."""
    mirror = _mirror(url)
    if not (mirror / "HEAD").exists():
        mirror.parent.mkdir(parents=True, exist_ok=True)
        tmp = mirror.with_name(f".{mirror.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _clone = _git(["clone", "--bare", "--quiet", "--", url, str(tmp)], check=False)
        if _clone.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _git_error(url, _clone.stderr)
        os.replace(tmp, mirror) if not mirror.exists() else shutil.rmtree(tmp, ignore_errors=True)
    else:
        fetched = _git(
            [
                "fetch",
                "--quiet",
                "--prune",
                "--force",
                "--",
                url,
                "+refs/heads/*:refs/heads/*",
                "+refs/tags/*:refs/tags/*",
            ],
            cwd=mirror,
            check=False,
        )
        if fetched.returncode != 0:
            raise _git_error(url, fetched.stderr)
    wanted = ref or "HEAD"
    resolved = _git(
        ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{wanted}^{{commit}}"], cwd=mirror, check=False
    )
    if resolved.returncode != 0:
        raise ConfigurationError(f"workload: {url} has no branch, tag or commit {wanted!r}")
    return resolved.stdout.strip()


def _git_error(url: str, stderr: str) -> Exception:
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "git failed"
    lowered = stderr.lower()
    if any(w in lowered for w in ("could not resolve host", "connection timed out", "connection refused", "early eof")):
        return TransientError(f"workload: cannot fetch {url}: {text}")
    return ConfigurationError(f"workload: cannot fetch {url}: {text} (check the URL and that this machine may read it)")


def _mirror(url: str) -> Path:
    return gpuferry_cache() / "git" / f"{hashlib.sha256(url.encode()).hexdigest()[:24]}.git"


def commit_files(url: str, commit: str, sub: str | None) -> list[str] | None:
    """The files of ``commit`` under ``sub``, relative to it: what the code archive of a git source holds, whatever
    a job run from the unpacked tree wrote into it since (``__pycache__``, outputs). None: the cache's mirror
    of the repository is gone."""
    if not (_mirror(url) / "HEAD").exists():
        return None
    listed = _git(
        ["ls-tree", "-r", "-z", "--name-only", "--full-tree", commit, "--", sub or "."], cwd=_mirror(url), check=False
    )
    if listed.returncode != 0:
        return None
    prefix = f"{sub}/" if sub else ""
    return sorted(p.removeprefix(prefix) for p in listed.stdout.split("\0") if p.startswith(prefix))


def _checkout(url: str, commit: str) -> Path:
    """The tree of ``commit``, unpacked once under the cache."""
    tree = gpuferry_cache() / "workloads" / commit
    if tree.is_dir():
        return tree
    mirror = _mirror(url)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=mirror, capture_output=True, timeout=GIT_TIMEOUT, check=True
    ).stdout
    tmp = tree.with_name(f".{commit}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp, filter="data")
    try:
        os.rename(tmp, tree)
    except OSError:  # another process unpacked it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def _local_git(root: Path) -> tuple[str | None, bool]:
    """``(commit of HEAD, uncommitted changes under root)`` when ``root`` is inside a git work tree."""
    try:
        head = _git(["rev-parse", "--verify", "--quiet", "HEAD"], cwd=root, check=False)
    except ConfigurationError:  # no git here: a plain directory
        return None, False
    if head.returncode != 0:
        return None, False
    status = _git(["status", "--porcelain", "--untracked-files=normal", "--", "."], cwd=root, check=False)
    return head.stdout.strip(), bool(status.stdout.strip())


def load_workload(source: str) -> Workload:
    """The workload at ``source`` (a local path or git+URL@REF#subdirectory=PATH), its definition checked."""
    if not source or not source.strip():
        raise ConfigurationError(
            "workload is empty: give the directory that holds gpuferry.yaml, or git+URL@REF#subdirectory=PATH"
        )
    source = source.strip()
    commit: str | None
    if source.startswith("git+"):
        url, ref, sub = parse_git_source(source)
        commit = _fetch(url, ref)
        root = _checkout(url, commit) / (sub or "")
        dirty = False
    else:
        path = Path(source).expanduser()
        root = path.parent if path.name == WORKLOAD_FILE else path
        if not root.is_dir():
            raise ConfigurationError(
                f"workload={source!r}: no such directory (give the directory that holds {WORKLOAD_FILE})"
            )
        root = root.resolve()
        commit, dirty = _local_git(root)
    definition_file = root / WORKLOAD_FILE
    if not definition_file.is_file():
        raise ConfigurationError(
            f"workload={source!r}: {definition_file} does not exist; write one (`gpuferry init` makes a skeleton) or "
            "point at the directory that has it"
        )
    definition = load_yaml(definition_file, WorkloadDefinition)
    return Workload(source=source, root=str(root), commit=commit, dirty=dirty, definition=definition)


# ---- the code archive -------------------------------------------------------------------------------


def workload_files(root: Path, *, use_git: bool = True) -> list[str]:
    """The workload's files, relative to ``root``, sorted: what git would commit (or every file outside git,
    or with ``use_git=False``, except hidden directories and ``__pycache__``)."""
    listed = None
    try:
        if use_git:
            out = _git(
                ["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "."], cwd=root, check=False
            )
            if out.returncode == 0:
                listed = [p for p in out.stdout.split("\0") if p]
    except ConfigurationError:
        listed = None
    if listed is None:
        listed = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in filenames:
                listed.append(Path(dirpath, name).relative_to(root).as_posix())
    return _plain_files(root, listed)


def state_dirs(root: Path) -> list[str]:
    """gpuferry's state directories inside the workload ``root``, relative to it: ``./.gpuferry``, and wherever
    ``$GPUFERRY_HOME`` points inside it (its MLflow store, its caches). Never the workload's files."""
    state = [".gpuferry"]
    with contextlib.suppress(ValueError):
        state.append(gpuferry_home().resolve().relative_to(root.resolve()).as_posix())
    return [s for s in state if s not in ("", ".")]


def under(path: str, dirs: list[str]) -> bool:
    """Whether the relative ``path`` is one of ``dirs`` or inside one."""
    return any(path == d or path.startswith(d + "/") for d in dirs)


def _plain_files(root: Path, listed: list[str]) -> list[str]:
    """The regular files of ``listed``, less what is never the workload's: git's own directory and gpuferry's state
    (``state_dirs``)."""
    skip = [".git", *state_dirs(root)]
    return sorted(p for p in listed if not under(p, skip) and (root / p).is_file() and not (root / p).is_symlink())


def code_archive(root: Path, files: list[str] | None = None) -> CodeRef:
    """``root``'s files (``files``, relative to it; None: ``workload_files``) as a deterministic ``.tar.gz``
    under ``$GPUFERRY_CACHE/code/<sha256>.tar.gz``."""
    files = workload_files(root) if files is None else _plain_files(root, files)
    if not files:
        raise ConfigurationError(f"workload {root} has no files to run")
    raw = gzip.compress(deterministic_tar((rel, root / rel) for rel in files), compresslevel=6, mtime=0)
    digest = hashlib.sha256(raw).hexdigest()
    target = gpuferry_cache() / "code" / f"{digest}.tar.gz"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_bytes(raw)
        os.replace(tmp, target)
    else:
        os.utime(target)  # used now: `gpuferry gc` frees archives by how long they went unused
    return CodeRef(root=str(root), archive=str(target), sha256=digest, files=len(files), size_bytes=len(raw))
