"""Local checkpoint store: verified copies, manifest last, unchanged files not copied again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from prefect.filesystems import LocalFileSystem

from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.storage import MANIFEST, LocalCheckpointStore, verify_checkpoint


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
