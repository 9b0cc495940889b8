"""A checkpoint's manifest, built from a local directory: path, size and sha256 of every file.

The format is ``runtime/contract.py``'s. The sha256 of each local file is remembered (``HashCache``), so storing
an unchanged checkpoint again does not read it. Used by gpuferry's checkpoint stores on the orchestrator and by
``python -m runtime.store`` on a cluster: the standard library and ``runtime.contract`` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from runtime import contract
from runtime.contract import manifest_bytes

MANIFEST = contract.MANIFEST_FILENAME


class EmptyCheckpoint(ValueError):
    """The directory holds no file to store."""


def default_cache_root() -> Path:
    """Where a process without gpuferry's home keeps its hashes: ``$GPUFERRY_HOME/cache`` or ``~/.cache/gpuferry``."""
    home = os.environ.get("GPUFERRY_HOME")
    return (Path(home) / "cache") if home else Path.home() / ".cache" / "gpuferry"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class HashCache:
    """The sha256 of local files, remembered so that an unchanged file is not read again.

    One small JSON file per hashed path under ``root``, keyed by (absolute path, size, mtime_ns, inode):
    a change to any of them (a rewrite, a touch, a replacement by rename) means the file is hashed again.
    A file changed again within the same timestamp tick as its hashing could keep its mtime, so a record
    made less than ``RACY_NS`` after the file's mtime is not trusted (git's "racily clean" rule): the
    file is hashed again, and that later record is trusted. Failing to write the cache only costs time.
    """

    RACY_NS = 1_000_000_000

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else default_cache_root() / "sha256"

    def sha256(self, path: Path) -> str:
        path = Path(path).absolute()
        key = self._key(path)
        try:
            record = json.loads(self._record_path(path).read_text())
            if {k: record.get(k) for k in key} == key and record["hashed_at_ns"] - key["mtime_ns"] >= self.RACY_NS:
                return record["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        hashed_at = time.time_ns()
        digest = sha256_file(path)
        self._write(path, key, digest, hashed_at)
        return digest

    def remember(self, path: Path, sha256: str, hashed_at_ns: int) -> None:
        """Record a hash computed elsewhere (while copying the file), taken at ``hashed_at_ns``."""
        path = Path(path).absolute()
        self._write(path, self._key(path), sha256, hashed_at_ns)

    @staticmethod
    def _key(path: Path) -> dict:
        st = path.stat()
        return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}

    def _record_path(self, path: Path) -> Path:
        return self.root / f"{hashlib.sha256(str(path).encode()).hexdigest()}.json"

    def _write(self, path: Path, key: dict, sha256: str, hashed_at_ns: int) -> None:
        record_path = self._record_path(path)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = record_path.with_name(f".{record_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**key, "sha256": sha256, "hashed_at_ns": hashed_at_ns}))
            os.replace(tmp, record_path)
        except OSError:
            pass


def checkpoint_files(local_dir: Path) -> list[Path]:
    """The files of a checkpoint directory in manifest order; an empty directory is an error."""
    files = sorted(_files(local_dir))
    if not files:
        raise EmptyCheckpoint(f"checkpoint directory {local_dir} is empty: nothing to store")
    return files


def manifest_entry(local_dir: Path, path: Path, cache: HashCache | None = None) -> dict:
    """One file's manifest entry (path relative to ``local_dir``, size, sha256 through the hash cache)."""
    digest = (cache or HashCache()).sha256(path)
    return {"path": path.relative_to(local_dir).as_posix(), "size": path.stat().st_size, "sha256": digest}


def manifest_from_entries(entries: list[dict]) -> dict:
    """The manifest of entries given in ``checkpoint_files`` order."""
    return {"format": contract.MANIFEST_FORMAT, "files": list(entries)}


def build_manifest(local_dir: Path, cache: HashCache | None = None) -> dict:
    """Path, size and sha256 of every file under ``local_dir`` (sorted, so the bytes are stable)."""
    cache = cache or HashCache()
    return manifest_from_entries([manifest_entry(local_dir, p, cache) for p in checkpoint_files(local_dir)])


def write_manifest(local_dir: str | Path, cache: HashCache | None = None) -> str:
    """Write ``MANIFEST.json`` into a checkpoint directory in place; returns the manifest's sha256."""
    root = Path(local_dir)
    raw = manifest_bytes(build_manifest(root, cache))
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_bytes(raw)
    os.replace(tmp, root / MANIFEST)
    return hashlib.sha256(raw).hexdigest()


def _files(root: Path) -> Iterator[Path]:
    for p in root.rglob("*"):
        if p.is_file() and p.name != MANIFEST:
            yield p
