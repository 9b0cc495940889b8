"""Checkpoints in a local directory: ``LocalCheckpointStore``, the embedded default store (over Prefect's
``LocalFileSystem`` block).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from prefect.filesystems import LocalFileSystem
from pydantic import Field

from blocks.base.storage import (
    MANIFEST,
    CheckpointStore,
    HashCache,
    _copy_verified,
    build_manifest,
    checkpoint_ref,
    local_path,
    read_manifest,
)
from blocks.checks import CheckRow, Probe, writable_dir
from blocks.errors import ConfigurationError
from blocks.records import CheckpointRef, Garbage
from runtime.contract import manifest_bytes
from runtime.manifest import manifest_from_entries, sha256_file  # noqa: F401 - re-exported


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

    def stored(self) -> list[Garbage]:
        out = []
        for manifest in sorted(self.root().rglob(MANIFEST)) if self.root().is_dir() else []:
            size = sum(p.stat().st_size for p in manifest.parent.rglob("*") if p.is_file())
            out.append(
                Garbage(
                    kind="checkpoint",
                    where=manifest.parent.as_uri(),
                    size_bytes=size,
                    modified=manifest.stat().st_mtime,
                )
            )
        return out

    def remove(self, uri: str) -> None:
        path = local_path(uri)
        if not path.resolve().is_relative_to(self.root()):
            raise ConfigurationError(f"{uri} is not a checkpoint of this store ({self.root()})")
        (path / MANIFEST).unlink(missing_ok=True)  # first: no reader trusts what is left
        shutil.rmtree(path, ignore_errors=True)

    def get(self, uri: str, dest: str | Path) -> Path:
        source = local_path(uri)
        manifest = read_manifest(source)
        out = Path(dest)
        for entry in manifest["files"]:
            _copy_verified(source / entry["path"], out / entry["path"], entry["sha256"])
        return out

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The directory is writable (nothing is created)."""
        probe.step(
            "directory", lambda: writable_dir(str(self.root())), "set filesystem.basepath to a writable directory"
        )
        return probe.rows
