"""Checkpoint storage: a checkpoint directory stored whole, verified, and stored once.

A stored checkpoint is a set of files plus ``MANIFEST.json`` (path, size and sha256 of each file),
written last: readers trust only checkpoints that have one. The format is written down once, in
``runtime/contract.py``, which the inference server reads too. A file whose sha256 already matches
what is stored is not sent again, so storing an unchanged checkpoint moves 0 bytes and an
interrupted upload resumes where it stopped. The checkpoint's identity is the sha256 of its
manifest.

Hashing a 2 GiB checkpoint takes seconds, so the sha256 of each local file is remembered in
``$GPUFERRY_HOME/cache/sha256/`` under (absolute path, size, mtime_ns, inode): a file none of
those changed for is not read again (see ``HashCache``).

The embedded default keeps checkpoints in a local directory (Prefect's ``LocalFileSystem`` block).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import Field

from blocks.checks import CheckRow, Probe, writable_dir
from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.home import gpuferry_home
from blocks.specs import CheckpointRef, check_name
from runtime import contract
from runtime.contract import manifest_bytes

MANIFEST = contract.MANIFEST_FILENAME
_CHUNK = 1 << 20


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
        self.root = root if root is not None else gpuferry_home() / "cache" / "sha256"

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
        raise ConfigurationError(f"checkpoint directory {local_dir} is empty: nothing to store")
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


def write_manifest(local_dir: str | Path) -> str:
    """Write ``MANIFEST.json`` into a checkpoint directory in place; returns the manifest's sha256."""
    root = Path(local_dir)
    raw = manifest_bytes(build_manifest(root))
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_bytes(raw)
    os.replace(tmp, root / MANIFEST)
    return hashlib.sha256(raw).hexdigest()


def parse_manifest(raw: bytes, where: str) -> dict:
    """A stored manifest, checked (``runtime.contract.parse_manifest``); ``ChecksumMismatch`` when it is not."""
    try:
        return contract.parse_manifest(raw, where)
    except contract.ManifestError as exc:
        raise ChecksumMismatch(str(exc)) from None


def checkpoint_ref(uri: str, raw_manifest: bytes, manifest: dict, bytes_uploaded: int) -> CheckpointRef:
    """The record of a stored checkpoint whose manifest bytes are ``raw_manifest``."""
    return CheckpointRef(
        uri=uri,
        sha256=hashlib.sha256(raw_manifest).hexdigest(),
        size_bytes=sum(e["size"] for e in manifest["files"]),
        files=len(manifest["files"]),
        bytes_uploaded=bytes_uploaded,
    )


def _files(root: Path) -> Iterator[Path]:
    for p in root.rglob("*"):
        if p.is_file() and p.name != MANIFEST:
            yield p


class CheckpointStore(Block, ABC):
    """Where checkpoints are stored between training and serving."""

    _block_type_name = "gpuferry Checkpoint Store"

    prefix: str = Field("checkpoints", description="Folder inside the storage that holds the checkpoints.")

    @abstractmethod
    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        """Store ``local_dir`` as checkpoint ``name``; verified, unchanged files skipped."""

    @abstractmethod
    def get(self, uri: str, dest: str | Path) -> Path:
        """Fetch the checkpoint at ``uri`` into ``dest``, verifying every file against its manifest."""

    @abstractmethod
    def read_manifest(self, uri: str) -> dict:
        """The stored checkpoint's manifest; ``ChecksumMismatch`` when it has none (its upload did not finish)."""

    @abstractmethod
    def _read_bytes(self, uri: str, path: str) -> bytes | None:
        """The stored bytes of one file of the checkpoint (None when absent), unchecked."""

    def read_file(self, uri: str, path: str) -> bytes | None:
        """One file of a stored checkpoint (``path`` relative to it), checked against the manifest; None when
        the manifest does not list it."""
        entry = next((e for e in self.read_manifest(uri)["files"] if e["path"] == path), None)
        if entry is None:
            return None
        data = self._read_bytes(uri, path)
        actual = hashlib.sha256(data or b"").hexdigest()
        if data is None or actual != entry["sha256"]:
            raise ChecksumMismatch(
                f"{uri}/{path}: sha256 {actual if data is not None else '(missing)'} but the manifest says "
                f"{entry['sha256']}: the stored checkpoint is corrupt; store it again"
            )
        return data

    @staticmethod
    def check_checkpoint_name(name: str) -> str:
        for part in name.split("/"):
            check_name(part, "checkpoint name")
        return name


class LocalCheckpointStore(CheckpointStore):
    """Checkpoints in a directory of this machine (or a mounted shared filesystem)."""

    _block_type_name = "gpuferry Local Checkpoint Store"
    _description = "Stores checkpoints, with a sha256 manifest, in a local directory."

    filesystem: LocalFileSystem = Field(
        default_factory=LocalFileSystem, description="The directory (Prefect LocalFileSystem block)."
    )

    def root(self) -> Path:
        return Path(self.filesystem.basepath or Path.cwd()).expanduser().resolve() / self.prefix

    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        source = Path(local_dir)
        target = self.root() / self.check_checkpoint_name(name)
        cache = HashCache()
        manifest = build_manifest(source, cache)
        target.mkdir(parents=True, exist_ok=True)
        moved = 0
        for entry in manifest["files"]:
            dest = target / entry["path"]
            if dest.exists() and dest.stat().st_size == entry["size"] and cache.sha256(dest) == entry["sha256"]:
                continue
            copied_at = time.time_ns()
            moved += _copy_verified(source / entry["path"], dest, entry["sha256"])
            cache.remember(dest, entry["sha256"], copied_at)  # it has the source's mtime: trusted at once
        raw = manifest_bytes(manifest)
        tmp = target / f".{MANIFEST}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, target / MANIFEST)  # last: the checkpoint now exists
        return checkpoint_ref(target.as_uri(), raw, manifest, moved)

    def read_manifest(self, uri: str) -> dict:
        return read_manifest(local_path(uri))

    def _read_bytes(self, uri: str, path: str) -> bytes | None:
        try:
            return (local_path(uri) / path).read_bytes()
        except FileNotFoundError:
            return None

    def get(self, uri: str, dest: str | Path) -> Path:
        source = local_path(uri)
        manifest = read_manifest(source)
        out = Path(dest)
        for entry in manifest["files"]:
            _copy_verified(source / entry["path"], out / entry["path"], entry["sha256"])
        return out

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The directory is writable (nothing is created)."""
        probe.step("directory", lambda: writable_dir(str(self.root())), "set filesystem.basepath to a writable directory")
        return probe.rows


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ConfigurationError(f"{uri!r} is not a local checkpoint URI (file://...)")
    return Path(unquote(parsed.path))


def read_manifest(checkpoint_dir: Path) -> dict:
    return parse_manifest(_manifest_raw(checkpoint_dir), str(checkpoint_dir))


def _manifest_raw(checkpoint_dir: Path) -> bytes:
    try:
        return (checkpoint_dir / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise ChecksumMismatch(
            f"{checkpoint_dir} has no {MANIFEST}: the checkpoint is incomplete (its upload did not finish)"
        ) from None


def verify_checkpoint(uri: str) -> str:
    """Check every file of a local checkpoint against its manifest (each read again, no cache); return the
    manifest's sha256."""
    root = local_path(uri)
    raw = _manifest_raw(root)
    for entry in parse_manifest(raw, str(root))["files"]:
        actual = sha256_file(root / entry["path"])
        if actual != entry["sha256"]:
            raise ChecksumMismatch(f"{root / entry['path']}: sha256 {actual} but the manifest says {entry['sha256']}")
    return hashlib.sha256(raw).hexdigest()


def _copy_verified(src: Path, dest: Path, expected_sha256: str) -> int:
    """Copy through a temporary file, hashing on the way; rename only when the hash matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    if digest.hexdigest() != expected_sha256:
        tmp.unlink(missing_ok=True)
        raise ChecksumMismatch(f"{src}: sha256 {digest.hexdigest()} but the manifest says {expected_sha256}")
    shutil.copystat(src, tmp)
    os.replace(tmp, dest)
    return size
