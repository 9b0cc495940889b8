"""The storage step's interface, and the stored checkpoint's format: a directory stored whole, verified, once.

A stored checkpoint is a set of files plus ``MANIFEST.json`` (path, size and sha256 of each file),
written last: readers trust only checkpoints that have one. The format is written down once, in
``runtime/contract.py``, which the inference server reads too. A file whose sha256 already matches
what is stored is not sent again, so storing an unchanged checkpoint moves 0 bytes and an
interrupted upload resumes where it stopped. The checkpoint's identity is the sha256 of its
manifest.

Hashing a 2 GiB checkpoint takes seconds, so the sha256 of each local file is remembered in
``$GPUFERRY_HOME/cache/sha256/`` under (absolute path, size, mtime_ns, inode): a file none of
those changed for is not read again (see ``HashCache``).

Stores: ``blocks/local/storage.py`` (a local directory) and ``blocks/storage/s3.py`` (S3-compatible).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from urllib.parse import unquote, urlparse

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks.checks import CheckRow, Probe
from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.home import gpuferry_home
from blocks.records import CheckpointRef, Garbage
from blocks.values import check_name
from runtime import contract, manifest
from runtime.manifest import manifest_from_entries, sha256_file  # re-exported

MANIFEST = contract.MANIFEST_FILENAME
_CHUNK = 1 << 20


class HashCache(manifest.HashCache):
    """``runtime.manifest.HashCache`` under ``$GPUFERRY_HOME/cache/sha256`` by default."""

    def __init__(self, root: Path | None = None) -> None:
        super().__init__(root if root is not None else gpuferry_home() / "cache" / "sha256")


def checkpoint_files(local_dir: Path) -> list[Path]:
    """The files of a checkpoint directory in manifest order; an empty directory is a ``ConfigurationError``."""
    try:
        return manifest.checkpoint_files(local_dir)
    except manifest.EmptyCheckpoint as exc:
        raise ConfigurationError(str(exc)) from None


def manifest_entry(local_dir: Path, path: Path, cache: HashCache | None = None) -> dict:
    """One file's manifest entry (path relative to ``local_dir``, size, sha256 through the hash cache)."""
    return manifest.manifest_entry(local_dir, path, cache or HashCache())


def build_manifest(local_dir: Path, cache: HashCache | None = None) -> dict:
    """Path, size and sha256 of every file under ``local_dir`` (sorted, so the bytes are stable)."""
    cache = cache or HashCache()
    return manifest_from_entries([manifest_entry(local_dir, p, cache) for p in checkpoint_files(local_dir)])


def write_manifest(local_dir: str | Path) -> str:
    """Write ``MANIFEST.json`` into a checkpoint directory in place; returns the manifest's sha256."""
    return manifest.write_manifest(local_dir, HashCache())


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


class RemoteDestination(BaseModel):
    """How a machine other than this one (a cluster that wrote the checkpoint) stores it with
    ``python -m runtime.store``: where to, its settings, and the secrets it needs (sent in a 0600 file)."""

    model_config = ConfigDict(frozen=True)

    uri: str
    env: dict[str, str] = Field(default_factory=dict, description="Settings (the endpoint, the region): no secrets.")
    secrets: dict[str, str] = Field(default_factory=dict, description="Credentials, as environment variables.")
    ca_bundle: bytes | None = Field(
        None, description="The CA certificate (PEM) that signed the store's TLS certificate."
    )
    args: list[str] = Field(default_factory=list, description="runtime.store's options (transfer settings).")


class CheckpointStore(Block, ABC):
    """Where checkpoints are stored between training and serving."""

    _block_type_name = "gpuferry Checkpoint Store"

    prefix: str = Field("checkpoints", description="Folder inside the storage that holds the checkpoints.")

    @abstractmethod
    def self_check(self, probe: Probe) -> list[CheckRow]:
        """What ``gpuferry check`` reports of this backend: each check a row of ``probe`` (``blocks/checks.py``). It
        only reads, or writes a probe object and deletes it; ``Stack.check`` runs it with a deadline."""

    @abstractmethod
    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        """Store ``local_dir`` as checkpoint ``name``; verified, unchanged files skipped."""

    @abstractmethod
    def get(self, uri: str, dest: str | Path) -> Path:
        """Fetch the checkpoint at ``uri`` into ``dest``, verifying every file against its manifest."""

    def reader_env(self) -> dict[str, SecretStr]:
        """What a model server on this machine needs in its environment to read checkpoints from this store
        (credentials included, hence secrets); nothing for a local directory."""
        return {}

    def remote_destination(self, name: str) -> RemoteDestination:
        """How another machine stores checkpoint ``name`` here; ``ConfigurationError`` when it cannot."""
        raise ConfigurationError(
            f"stack.storage ({type(self).__name__}) keeps checkpoints on this machine, which a remote cluster's jobs "
            "cannot reach: use a store both reach (S3CheckpointStore: AWS S3, MinIO, Ceph), or run the flow on the "
            "cluster's login node (SlurmCluster local=True)"
        )

    @abstractmethod
    def read_manifest(self, uri: str) -> dict:
        """The stored checkpoint's manifest; ``ChecksumMismatch`` when it has none (its upload did not finish)."""

    def stored(self) -> list[Garbage]:
        """Every stored checkpoint (one with a manifest) under ``prefix``: its URI, size and when its manifest was
        written (what ``gpuferry gc`` weighs). A store that cannot list its checkpoints says so."""
        raise ConfigurationError(f"{type(self).__name__} cannot list its checkpoints: gpuferry gc leaves it alone")

    def remove(self, uri: str) -> None:
        """Delete the stored checkpoint at ``uri``, its manifest first (readers stop trusting it at once)."""
        raise ConfigurationError(f"{type(self).__name__} cannot delete checkpoints")

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
