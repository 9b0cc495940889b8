"""S3 checkpoint store against a real S3-compatible server (moto's, started by `make s3-up`)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
import pytest
from botocore.config import Config
from prefect_aws import AwsCredentials, S3Bucket
from prefect_aws.client_parameters import AwsClientParameters

from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.s3 import S3CheckpointStore
from blocks.storage import MANIFEST, build_manifest, manifest_bytes
from tasks.retry import is_transient
from tests.stacks import stack_env
from tests.test_storage import hashed  # noqa: F401  (fixture: the local files read to hash them)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _credentials(env: dict[str, str], endpoint: str, **config: object) -> AwsCredentials:
    return AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint, config=config or None),
    )


def _raw_client(env: dict[str, str], endpoint: str) -> object:
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"],
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2}),
    )  # fmt: skip


def _empty_bucket(s3: object, bucket: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def s3env() -> dict[str, str]:
    return stack_env("s3")


@pytest.fixture(scope="module")
def bucket(s3env: dict[str, str]) -> Iterator[str]:
    name = f"gpuferry-test-{uuid.uuid4().hex[:10]}"
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    s3.create_bucket(Bucket=name)
    yield name
    _empty_bucket(s3, name)


@pytest.fixture
def store(s3env: dict[str, str], bucket: str) -> S3CheckpointStore:
    # Small thresholds so a few MiB already exercise multipart uploads and ranged downloads.
    return S3CheckpointStore(
        bucket=S3Bucket(bucket_name=bucket, credentials=_credentials(s3env, s3env["S3_ENDPOINT_URL"])),
        multipart_threshold_mib=5, multipart_chunksize_mib=5, download_chunksize_mib=5,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def own_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A hash cache and upload journal of this test's own."""
    monkeypatch.setenv("GPUFERRY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    (src / "shards").mkdir(parents=True)
    (src / "model.pt").write_bytes(os.urandom(11 * MiB + 123))  # 3 parts
    (src / "shards" / "0.bin").write_bytes(os.urandom(300_000))
    (src / "shards" / "1.bin").write_bytes(os.urandom(200_000))
    (src / "metrics.json").write_text('{"val_accuracy": 0.97}')
    past = time.time_ns() - 60 * 10**9  # written a while before it is stored (see HashCache: racily clean files)
    for path in src.rglob("*"):
        os.utime(path, ns=(past, past))
    return src


class Wire:
    """What a client sends, counted at the wire (botocore's before-send event): operation, key, part, bytes."""

    def __init__(self, client: object) -> None:
        self.client = client
        self.requests: list[tuple[str, str, int | None, int]] = []
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request: object, event_name: str, **_: object) -> None:
        url = urlsplit(request.url)
        part = parse_qs(url.query).get("partNumber")
        key = unquote(url.path).split("/", 2)[2] if url.path.count("/") >= 2 else ""
        headers = request.headers
        size = int(headers.get("X-Amz-Decoded-Content-Length") or headers.get("Content-Length") or 0)
        self.requests.append((event_name.rsplit(".", 1)[1], key, int(part[0]) if part else None, size))

    def close(self) -> None:
        self.client.meta.events.unregister("before-send.s3", self._seen)

    def sent(self, operation: str | None = None) -> list[tuple[str, str, int | None, int]]:
        return [r for r in self.requests if operation is None or r[0] == operation]

    def body_bytes(self) -> int:
        """Bytes of checkpoint files sent (object and part bodies; not the manifest)."""
        bodies = ("PutObject", "UploadPart")
        return sum(size for op, key, _, size in self.requests if op in bodies and not key.endswith(f"/{MANIFEST}"))



def _unique(prefix: str) -> str:
    return f"{prefix}/{uuid.uuid4().hex[:8]}"


def test_round_trip(store: S3CheckpointStore, checkpoint: Path, tmp_path: Path, s3env: dict[str, str]) -> None:
    name = _unique("model")
    ref = store.put(checkpoint, name)
    expected = build_manifest(checkpoint)
    assert ref.uri == f"s3://{store.bucket.bucket_name}/checkpoints/{name}"
    assert ref.files == 4 and ref.size_bytes == ref.bytes_uploaded == sum(e["size"] for e in expected["files"])
    # The same manifest bytes, hence the same identity, as the local store gives this directory.
    assert ref.sha256 == hashlib.sha256(manifest_bytes(expected)).hexdigest()
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    head = s3.head_object(Bucket=store.bucket.bucket_name, Key=f"checkpoints/{name}/model.pt")
    assert head["Metadata"]["sha256"] == hashlib.sha256((checkpoint / "model.pt").read_bytes()).hexdigest()
    assert head["ETag"].strip('"').endswith("-3")  # stored in parts

    out = store.get(ref.uri, tmp_path / "out")
    for entry in expected["files"]:
        assert (out / entry["path"]).read_bytes() == (checkpoint / entry["path"]).read_bytes()
    assert not list(out.rglob(".*.partial"))


def test_unchanged_reupload_moves_nothing(store: S3CheckpointStore, checkpoint: Path, hashed: list[str]) -> None:
    name = _unique("model")
    first = store.put(checkpoint, name)
    assert sorted(hashed) == ["0.bin", "1.bin", "metrics.json", "model.pt"]
    hashed.clear()
    wire = Wire(store.client())
    try:
        second = store.put(checkpoint, name)
    finally:
        wire.close()
    assert second.bytes_uploaded == 0 and wire.sent("PutObject") == wire.sent("UploadPart") == []
    assert hashed == []  # nor read again: the hash cache knows the files
    assert second.sha256 == first.sha256
    (checkpoint / "metrics.json").write_text('{"val_accuracy": 0.98}')
    third = store.put(checkpoint, name)
    assert hashed == ["metrics.json"]
    assert third.bytes_uploaded == len('{"val_accuracy": 0.98}')
    assert third.sha256 != first.sha256
    assert store.read_manifest(third.uri)["files"][0] == {
        "path": "metrics.json", "size": 22,
        "sha256": hashlib.sha256(b'{"val_accuracy": 0.98}').hexdigest(),
    }  # fmt: skip


def test_corrupted_object_detected_on_download(
    store: S3CheckpointStore, checkpoint: Path, tmp_path: Path, s3env: dict[str, str]
) -> None:
    name = _unique("model")
    ref = store.put(checkpoint, name)
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    key = f"checkpoints/{name}/shards/1.bin"
    # Same size and the same sha256 claimed in its metadata: only the bytes differ.
    claimed = s3.head_object(Bucket=store.bucket.bucket_name, Key=key)["Metadata"]
    s3.put_object(Bucket=store.bucket.bucket_name, Key=key, Body=os.urandom(200_000), Metadata=claimed)
    with pytest.raises(ChecksumMismatch, match=rf"s3://{store.bucket.bucket_name}/{key}: sha256 \w+ but the manifest"):
        store.get(ref.uri, tmp_path / "out")
    assert not (tmp_path / "out" / "shards" / "1.bin").exists()
    assert not list((tmp_path / "out").rglob(".*.partial"))


def test_checkpoint_without_manifest_is_not_trusted(
    store: S3CheckpointStore, checkpoint: Path, tmp_path: Path, s3env: dict[str, str]
) -> None:
    name = _unique("model")
    ref = store.put(checkpoint, name)
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    s3.delete_object(Bucket=store.bucket.bucket_name, Key=f"checkpoints/{name}/{MANIFEST}")
    with pytest.raises(ChecksumMismatch, match="no MANIFEST.json: the checkpoint is incomplete"):
        store.get(ref.uri, tmp_path / "out")
    # A manifest that points outside the checkpoint is refused before anything is written.
    s3.put_object(
        Bucket=store.bucket.bucket_name, Key=f"checkpoints/{name}/{MANIFEST}",
        Body=b'{"format":1,"files":[{"path":"../../etc/x","size":1,"sha256":"00"}]}',
    )  # fmt: skip
    with pytest.raises(ChecksumMismatch, match="unsafe path '../../etc/x'"):
        store.get(ref.uri, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_configuration_errors_name_the_fix(s3env: dict[str, str], checkpoint: Path) -> None:
    credentials = _credentials(s3env, s3env["S3_ENDPOINT_URL"])
    missing = S3CheckpointStore(bucket=S3Bucket(bucket_name="no-such-bucket-gpuferry", credentials=credentials))
    with pytest.raises(ConfigurationError, match="NoSuchBucket: the bucket does not exist: .* fix bucket.bucket_name"):
        missing.put(checkpoint, "m/r")
    with pytest.raises(ConfigurationError, match="not an S3 checkpoint URI"):
        missing.get("file:///tmp/x", "/tmp/never")
    with pytest.raises(ValueError, match="checkpoint name"):
        missing.put(checkpoint, "../escape")


# ---- an interrupted upload, on a server of this test's own -----------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def own_moto(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A moto server only this test uses (the shared one must not be stopped)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "moto.log", "wb")
    proc = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "moto.log").read_text()
                assert time.monotonic() < deadline, "moto server did not start within 60 s"
                time.sleep(0.1)
        yield endpoint, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def test_interrupted_upload_resumes_without_resending_finished_files_or_parts(
    own_moto: tuple[str, subprocess.Popen], s3env: dict[str, str], tmp_path: Path
) -> None:
    endpoint, proc = own_moto
    s3 = _raw_client(s3env, endpoint)
    s3.create_bucket(Bucket="resume")
    src = tmp_path / "big"
    src.mkdir()
    size = 16 * MiB  # 4 parts of 5, 5, 5 and 1 MiB
    for i in range(6):
        (src / f"shard-{i}.bin").write_bytes(os.urandom(size))
    total = 6 * size
    tuning = {"multipart_threshold_mib": 5, "multipart_chunksize_mib": 5, "max_concurrency": 2, "max_parallel_files": 1}
    # The client gives up quickly once the server stops answering.
    impatient = S3CheckpointStore(
        bucket=S3Bucket(bucket_name="resume", credentials=_credentials(
            s3env, endpoint, connect_timeout=2, read_timeout=3, retries={"max_attempts": 1, "mode": "standard"})),
        **tuning,
    )  # fmt: skip

    # Stop the server (SIGSTOP: the process, with what it stored, stays) once at least one file is stored and the
    # next one has a finished part. What is seen finished here is a lower bound: more may finish before the stop.
    seen_files: set[str] = set()
    seen_parts: dict[str, dict[int, int]] = {}  # key → part number → size
    stopped = threading.Event()

    def stop_midway() -> None:
        watcher = _raw_client(s3env, endpoint)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            files = [o["Key"] for o in watcher.list_objects_v2(Bucket="resume").get("Contents", [])]
            parts = {
                u["Key"]: {p["PartNumber"]: p["Size"] for p in watcher.list_parts(
                    Bucket="resume", Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])}
                for u in watcher.list_multipart_uploads(Bucket="resume").get("Uploads", [])
            }  # fmt: skip
            if files and any(parts.values()) and len(files) <= 4:  # at least one more file to send
                proc.send_signal(signal.SIGSTOP)
                seen_files.update(files)
                seen_parts.update({key: numbers for key, numbers in parts.items() if numbers})
                stopped.set()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=stop_midway, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Exception) as interrupted:
            impatient.put(src, "m/run1")
    finally:
        watcher.join(timeout=130)
        proc.send_signal(signal.SIGCONT)
    assert stopped.is_set(), "the upload finished before the server could be stopped"
    assert is_transient(interrupted.value), f"{interrupted.value!r} should be classified transient"
    assert 1 <= len(seen_files) < 6 and seen_parts, (seen_files, seen_parts)
    (interrupted_key,) = seen_parts
    # An upload of other content left under the checkpoint (another machine's attempt, say): never resumed.
    stale = s3.create_multipart_upload(Bucket="resume", Key="checkpoints/m/run1/shard-5.bin")
    s3.upload_part(Bucket="resume", Key="checkpoints/m/run1/shard-5.bin", UploadId=stale["UploadId"],
                   PartNumber=1, Body=b"x" * (5 * MiB))  # fmt: skip

    patient = S3CheckpointStore(
        bucket=S3Bucket(bucket_name="resume", credentials=_credentials(s3env, endpoint)), **tuning
    )
    with pytest.raises(ChecksumMismatch, match="incomplete"):
        patient.read_manifest(patient.uri_of("m/run1"))  # no manifest: readers do not trust it yet
    wire = Wire(patient.client())
    try:
        resumed = patient.put(src, "m/run1")
    finally:
        wire.close()
    sent_keys = {key for _, key, _, _ in wire.sent("PutObject") + wire.sent("UploadPart")}
    assert not sent_keys & seen_files, "a finished file was sent again"
    # The interrupted file's upload was resumed, not begun again, and its finished parts were not sent again.
    assert interrupted_key not in {key for _, key, _, _ in wire.sent("CreateMultipartUpload")}
    resent = {part for _, key, part, _ in wire.sent("UploadPart") if key == interrupted_key}
    assert not resent & seen_parts[interrupted_key].keys(), f"parts {resent} of {interrupted_key} sent again"
    # Bytes counted at the wire: at most what was not seen finished, and what the store reports.
    unfinished = total - len(seen_files) * size - sum(seen_parts[interrupted_key].values())
    assert 0 < wire.body_bytes() <= unfinished
    assert resumed.bytes_uploaded == wire.body_bytes()
    assert resumed.size_bytes == total and resumed.files == 6
    out = patient.get(resumed.uri, tmp_path / "out")
    for i in range(6):
        assert (out / f"shard-{i}.bin").read_bytes() == (src / f"shard-{i}.bin").read_bytes()
    assert patient.put(src, "m/run1").bytes_uploaded == 0
    # Unfinished uploads under the now complete checkpoint (the stale one) were aborted.
    assert s3.list_multipart_uploads(Bucket="resume", Prefix="checkpoints/").get("Uploads", []) == []


def test_resume_checks_each_stored_part_and_the_content(
    store: S3CheckpointStore, tmp_path: Path, s3env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted multipart upload is resumed only for the same content, and only parts whose ETag is the MD5
    of the local bytes are kept."""
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(18 * MiB))  # 4 parts of 5, 5, 5, 3 MiB
    name = _unique("model")
    key = f"checkpoints/{name}/model.pt"
    client, bucket = store.client(), store.bucket.bucket_name
    real_upload_part = client.upload_part

    def fail_from_part_3(**kwargs: object) -> dict:
        if kwargs["PartNumber"] >= 3:
            raise ConnectionResetError("connection reset by peer")
        return real_upload_part(**kwargs)

    with monkeypatch.context() as patched, pytest.raises(ConnectionResetError):
        patched.setattr(client, "upload_part", fail_from_part_3)
        store.put(src, name)
    (pending,) = _raw_client(s3env, s3env["S3_ENDPOINT_URL"]).list_multipart_uploads(
        Bucket=bucket, Prefix=key).get("Uploads", [])  # fmt: skip
    # Part 2 as stored no longer matches the local bytes (written over by someone else): it is sent again.
    _raw_client(s3env, s3env["S3_ENDPOINT_URL"]).upload_part(
        Bucket=bucket, Key=key, UploadId=pending["UploadId"], PartNumber=2, Body=os.urandom(5 * MiB))

    wire = Wire(client)
    try:
        resumed = store.put(src, name)
    finally:
        wire.close()
    assert wire.sent("CreateMultipartUpload") == []
    assert sorted(part for _, _, part, _ in wire.sent("UploadPart")) == [2, 3, 4]
    assert resumed.bytes_uploaded == wire.body_bytes() == 18 * MiB - 5 * MiB
    assert (store.get(resumed.uri, tmp_path / "out") / "model.pt").read_bytes() == (src / "model.pt").read_bytes()

    # Interrupted again, then the file changes: the pending upload carries other content, so it starts afresh.
    (src / "model.pt").write_bytes(os.urandom(18 * MiB))
    with monkeypatch.context() as patched, pytest.raises(ConnectionResetError):
        patched.setattr(client, "upload_part", fail_from_part_3)
        store.put(src, name)
    (src / "model.pt").write_bytes(os.urandom(18 * MiB))
    wire = Wire(client)
    try:
        fresh = store.put(src, name)
    finally:
        wire.close()
    assert [k for _, k, _, _ in wire.sent("CreateMultipartUpload")] == [key]
    assert sorted(part for _, _, part, _ in wire.sent("UploadPart")) == [1, 2, 3, 4]
    assert fresh.bytes_uploaded == 18 * MiB
    assert (store.get(fresh.uri, tmp_path / "out2") / "model.pt").read_bytes() == (src / "model.pt").read_bytes()
    assert _raw_client(s3env, s3env["S3_ENDPOINT_URL"]).list_multipart_uploads(
        Bucket=bucket, Prefix=key).get("Uploads", []) == []  # fmt: skip


def test_server_down_is_transient(s3env: dict[str, str], checkpoint: Path) -> None:
    down = S3CheckpointStore(
        bucket=S3Bucket(bucket_name="any", credentials=_credentials(
            s3env, f"http://127.0.0.1:{_free_port()}", connect_timeout=1, retries={"max_attempts": 1})),
    )  # fmt: skip
    with pytest.raises(Exception) as info:
        down.put(checkpoint, "m/r")
    assert is_transient(info.value), repr(info.value)
