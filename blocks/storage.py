"""Checkpoint storage: a checkpoint directory stored whole, verified, and stored once.

A stored checkpoint is a set of files plus ``MANIFEST.json`` (path, size and sha256 of each file),
written last: readers trust only checkpoints that have one. A file whose sha256 already matches
what is stored is not sent again, so storing an unchanged checkpoint moves 0 bytes and an
interrupted upload resumes where it stopped. The checkpoint's identity is the sha256 of its
manifest.

The embedded default keeps checkpoints in a local directory (Prefect's ``LocalFileSystem`` block).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import Field

from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.specs import CheckpointRef, check_name

MANIFEST = "MANIFEST.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(local_dir: Path) -> dict:
    """Path, size and sha256 of every file under ``local_dir`` (sorted, so the bytes are stable)."""
    files = [
        {"path": p.relative_to(local_dir).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(_files(local_dir))
    ]
    if not files:
        raise ConfigurationError(f"checkpoint directory {local_dir} is empty: nothing to store")
    return {"format": 1, "files": files}


def manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_files(local_dir: Path) -> list[Path]:
    """The files of a checkpoint directory in manifest order; an empty directory is an error."""
    files = sorted(_files(local_dir))
    if not files:
        raise ConfigurationError(f"checkpoint directory {local_dir} is empty: nothing to store")
    return files


def manifest_entry(local_dir: Path, path: Path) -> dict:
    """One file's manifest entry (path relative to ``local_dir``, size, sha256)."""
    return {"path": path.relative_to(local_dir).as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}


def manifest_from_entries(entries: list[dict]) -> dict:
    """The manifest of entries given in ``checkpoint_files`` order: the same bytes as ``build_manifest``."""
    return {"format": 1, "files": list(entries)}


def parse_manifest(raw: bytes, where: str) -> dict:
    """A stored manifest, checked: known format, and every path relative and inside the checkpoint."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        ok = manifest.get("format") == 1 and all(
            isinstance(e["path"], str) and isinstance(e["size"], int) and isinstance(e["sha256"], str) for e in files
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ChecksumMismatch(f"{where}: {MANIFEST} is not a gpuferry manifest (format 1)")
    for entry in files:
        parts = entry["path"].split("/")
        if entry["path"].startswith("/") or ".." in parts or "" in parts or entry["path"] == MANIFEST:
            raise ChecksumMismatch(f"{where}: {MANIFEST} lists an unsafe path {entry['path']!r}")
    return manifest


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
        manifest = build_manifest(source)
        target.mkdir(parents=True, exist_ok=True)
        moved = 0
        for entry in manifest["files"]:
            dest = target / entry["path"]
            if dest.exists() and dest.stat().st_size == entry["size"] and sha256_file(dest) == entry["sha256"]:
                continue
            moved += _copy_verified(source / entry["path"], dest, entry["sha256"])
        raw = manifest_bytes(manifest)
        tmp = target / f".{MANIFEST}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, target / MANIFEST)  # last: the checkpoint now exists
        return CheckpointRef(
            uri=target.as_uri(),
            sha256=hashlib.sha256(raw).hexdigest(),
            size_bytes=sum(e["size"] for e in manifest["files"]),
            files=len(manifest["files"]),
            bytes_uploaded=moved,
        )

    def get(self, uri: str, dest: str | Path) -> Path:
        source = local_path(uri)
        manifest = read_manifest(source)
        out = Path(dest)
        for entry in manifest["files"]:
            _copy_verified(source / entry["path"], out / entry["path"], entry["sha256"])
        return out


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise ConfigurationError(f"{uri!r} is not a local checkpoint URI (file://...)")
    return Path(unquote(parsed.path))


def read_manifest(checkpoint_dir: Path) -> dict:
    try:
        return json.loads((checkpoint_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise ChecksumMismatch(
            f"{checkpoint_dir} has no {MANIFEST}: the checkpoint is incomplete (its upload did not finish)"
        ) from None


def verify_checkpoint(uri: str) -> str:
    """Check every file of a local checkpoint against its manifest; return the manifest's sha256."""
    root = local_path(uri)
    raw = (root / MANIFEST).read_bytes()
    for entry in json.loads(raw)["files"]:
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
