"""Local checkpoint store: verified copies, manifest last, unchanged files not copied again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from prefect.filesystems import LocalFileSystem

import runtime.manifest
from blocks.base.storage import MANIFEST, HashCache, verify_checkpoint
from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.local.storage import LocalCheckpointStore


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    (src / "shards").mkdir(parents=True)
    (src / "model.pt").write_bytes(b"weights" * 1000)
    (src / "shards" / "0.bin").write_bytes(bytes(range(256)) * 100)
    (src / "metrics.json").write_text('{"val_accuracy": 0.97}')
    return src


@pytest.fixture
def store(tmp_path: Path) -> LocalCheckpointStore:
    return LocalCheckpointStore(filesystem=LocalFileSystem(basepath=str(tmp_path / "store")))


def test_round_trip(store: LocalCheckpointStore, checkpoint: Path, tmp_path: Path) -> None:
    ref = store.put(checkpoint, "model/run1")
    assert ref.files == 3 and ref.bytes_uploaded == ref.size_bytes == 7000 + 25600 + 22
    stored = Path(ref.uri.removeprefix("file://"))
    assert hashlib.sha256((stored / MANIFEST).read_bytes()).hexdigest() == ref.sha256
    assert verify_checkpoint(ref.uri) == ref.sha256
    out = store.get(ref.uri, tmp_path / "out")
    for name in ("model.pt", "shards/0.bin", "metrics.json"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes()


def test_unchanged_reupload_moves_nothing(store: LocalCheckpointStore, checkpoint: Path) -> None:
    first = store.put(checkpoint, "model/run1")
    second = store.put(checkpoint, "model/run1")
    assert second.bytes_uploaded == 0
    assert second.sha256 == first.sha256
    (checkpoint / "metrics.json").write_text('{"val_accuracy": 0.98}')
    third = store.put(checkpoint, "model/run1")
    assert third.bytes_uploaded == len('{"val_accuracy": 0.98}')
    assert third.sha256 != first.sha256


def test_interrupted_upload_resumes(store: LocalCheckpointStore, checkpoint: Path) -> None:
    full = store.put(checkpoint, "model/run1")
    stored = Path(full.uri.removeprefix("file://"))
    # As if the upload stopped after the first file: no manifest, one file missing.
    (stored / MANIFEST).unlink()
    (stored / "shards" / "0.bin").unlink()
    with pytest.raises(ChecksumMismatch, match="no MANIFEST.json"):
        store.get(full.uri, stored.parent / "out")
    resumed = store.put(checkpoint, "model/run1")
    assert resumed.bytes_uploaded == 25600
    assert resumed.sha256 == full.sha256


def test_corruption_detected(store: LocalCheckpointStore, checkpoint: Path, tmp_path: Path) -> None:
    ref = store.put(checkpoint, "model/run1")
    stored = Path(ref.uri.removeprefix("file://"))
    (stored / "model.pt").write_bytes(b"tampered" * 875)
    with pytest.raises(ChecksumMismatch, match="model.pt: sha256 .* but the manifest says"):
        store.get(ref.uri, tmp_path / "out")
    with pytest.raises(ChecksumMismatch):
        verify_checkpoint(ref.uri)
    assert not (tmp_path / "out" / "model.pt").exists()


def test_manifest_lists_every_file(store: LocalCheckpointStore, checkpoint: Path) -> None:
    ref = store.put(checkpoint, "m/r")
    manifest = json.loads((Path(ref.uri.removeprefix("file://")) / MANIFEST).read_text())
    assert [f["path"] for f in manifest["files"]] == ["metrics.json", "model.pt", "shards/0.bin"]


def test_bad_names_and_empty_dirs(store: LocalCheckpointStore, tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint name"):
        store.put(checkpoint, "../escape")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigurationError, match="empty"):
        store.put(tmp_path / "empty", "m/r")


# ---- the hash cache ---------------------------------------------------------------------------


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The files actually read to hash them (by name), in a cache of this test's own."""
    monkeypatch.setenv("GPUFERRY_HOME", str(tmp_path / "home"))
    calls: list[str] = []
    real = runtime.manifest.sha256_file

    def counting(path: Path) -> str:
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(runtime.manifest, "sha256_file", counting)  # where the hash cache hashes
    return calls


def _age(*paths: Path) -> None:
    """Set the files' mtime a minute back, as for a checkpoint written a while before it is stored."""
    past = time.time_ns() - 60 * 10**9
    for path in paths:
        os.utime(path, ns=(past, past))


def test_unchanged_files_are_not_hashed_again(hashed: list[str], store: LocalCheckpointStore, checkpoint: Path) -> None:
    files = [checkpoint / "model.pt", checkpoint / "shards" / "0.bin", checkpoint / "metrics.json"]
    _age(*files)
    first = store.put(checkpoint, "model/run1")
    assert sorted(hashed) == ["0.bin", "metrics.json", "model.pt"]  # the sources; the copies are hashed as copied
    hashed.clear()
    again = store.put(checkpoint, "model/run1")
    assert hashed == [] and again.bytes_uploaded == 0 and again.sha256 == first.sha256

    # Touched (same bytes, another mtime): read again, nothing sent. Replaced by a copy with the same size and
    # mtime (a new inode): read again too. The other file: not read.
    earlier = time.time_ns() - 120 * 10**9
    os.utime(checkpoint / "model.pt", ns=(earlier, earlier))
    replacement = checkpoint / "shards" / ".0.bin.new"
    shutil.copy2(checkpoint / "shards" / "0.bin", replacement)
    os.replace(replacement, checkpoint / "shards" / "0.bin")
    touched = store.put(checkpoint, "model/run1")
    assert sorted(hashed) == ["0.bin", "model.pt"]
    assert touched.bytes_uploaded == 0 and touched.sha256 == first.sha256
    hashed.clear()
    # New content of the same size: read (once: the stored copy's hash is the one recorded as it was copied).
    (checkpoint / "metrics.json").write_text('{"val_accuracy": 0.98}')
    changed = store.put(checkpoint, "model/run1")
    assert hashed == ["metrics.json"]
    assert changed.bytes_uploaded == 22 and changed.sha256 != first.sha256
    assert verify_checkpoint(changed.uri) == changed.sha256


def test_a_file_hashed_just_after_it_was_written_is_hashed_again(hashed: list[str], tmp_path: Path) -> None:
    cache = HashCache(tmp_path / "cache")
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"x" * 1000)
    digest = hashlib.sha256(b"x" * 1000).hexdigest()
    # Written within the timestamp granularity of its hashing, it could change again without a new mtime.
    assert cache.sha256(fresh) == digest and cache.sha256(fresh) == digest
    assert hashed == ["fresh.bin", "fresh.bin"]
    _age(fresh)
    hashed.clear()
    assert [cache.sha256(fresh) for _ in range(3)] == [digest] * 3
    assert hashed == ["fresh.bin"]
    # A size change with mtime and inode kept is caught by the size.
    stat = fresh.stat()
    fresh.write_bytes(b"y" * 1001)
    os.utime(fresh, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cache.sha256(fresh) == hashlib.sha256(b"y" * 1001).hexdigest()
