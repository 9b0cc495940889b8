"""S3 checkpoint store against a real S3 server: Ceph RGW, the s3 stack (`make s3-up`), over http and https."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
import pytest
from botocore.config import Config
from prefect_aws import AwsCredentials, S3Bucket
from prefect_aws.client_parameters import AwsClientParameters

from blocks.base.storage import MANIFEST, build_manifest
from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.storage.s3 import S3CheckpointStore
from runtime.contract import manifest_bytes
from tasks.retry import is_transient
from tests.stacks import stack_env
from tests.test_storage import hashed  # noqa: F401 - fixture: the local files read to hash them

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
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2}),
    )


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
        multipart_threshold_mib=5,
        multipart_chunksize_mib=5,
        download_chunksize_mib=5,
    )


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
        self.headers: list[dict[str, str]] = []  # of each request, in the same order
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request: object, event_name: str, **_: object) -> None:
        url = urlsplit(request.url)
        part = parse_qs(url.query).get("partNumber")
        key = unquote(url.path).split("/", 2)[2] if url.path.count("/") >= 2 else ""
        headers = request.headers
        size = int(headers.get("X-Amz-Decoded-Content-Length") or headers.get("Content-Length") or 0)
        self.requests.append((event_name.rsplit(".", 1)[1], key, int(part[0]) if part else None, size))
        self.headers.append(
            {
                name.lower(): value.decode() if isinstance(value, bytes) else str(value)
                for name, value in headers.items()
            }
        )

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
        "path": "metrics.json",
        "size": 22,
        "sha256": hashlib.sha256(b'{"val_accuracy": 0.98}').hexdigest(),
    }


def test_corrupted_object_detected_on_download(
    store: S3CheckpointStore, checkpoint: Path, tmp_path: Path, s3env: dict[str, str]
) -> None:
    name = _unique("model")
    ref = store.put(checkpoint, name)
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    bucket = store.bucket.bucket_name
    key = f"checkpoints/{name}/shards/1.bin"
    # Same size and the same sha256 claimed in its metadata: only the bytes differ.
    claimed = s3.head_object(Bucket=bucket, Key=key)["Metadata"]
    s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(200_000), Metadata=claimed)
    with pytest.raises(ChecksumMismatch, match=rf"s3://{bucket}/{key}: sha256 \w+ \(200000 bytes\) but MANIFEST.json"):
        store.get(ref.uri, tmp_path / "out")
    assert not (tmp_path / "out" / "shards" / "1.bin").exists()
    assert not list((tmp_path / "out").rglob(".*.partial"))

    # One byte of the large file (fetched in 3 ranged GETs) flipped in its middle range, then the file shortened.
    s3.put_object(Bucket=bucket, Key=key, Body=(checkpoint / "shards" / "1.bin").read_bytes(), Metadata=claimed)
    big = f"checkpoints/{name}/model.pt"
    data = bytearray((checkpoint / "model.pt").read_bytes())
    data[7 * MiB] ^= 0x01
    metadata = s3.head_object(Bucket=bucket, Key=big)["Metadata"]
    s3.put_object(Bucket=bucket, Key=big, Body=bytes(data), Metadata=metadata)
    with pytest.raises(ChecksumMismatch, match=rf"s3://{bucket}/{big}: sha256 \w+ \({len(data)} bytes\) but MANIFEST"):
        store.get(ref.uri, tmp_path / "out2")
    s3.put_object(Bucket=bucket, Key=big, Body=bytes(data[: 10 * MiB]), Metadata=metadata)
    with pytest.raises(
        ChecksumMismatch,
        match=rf"s3://{bucket}/{big}: sha256 \(not read\) \({10 * MiB} bytes\) but "
        rf"MANIFEST.json says \w+ \({len(data)} bytes\)",
    ):
        store.get(ref.uri, tmp_path / "out3")
    for out in ("out2", "out3"):
        assert not (tmp_path / out / "model.pt").exists() and not list((tmp_path / out).rglob(".*.partial"))


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
        Bucket=store.bucket.bucket_name,
        Key=f"checkpoints/{name}/{MANIFEST}",
        Body=b'{"format":1,"files":[{"path":"../../etc/x","size":1,"sha256":"00"}]}',
    )
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


def test_wrong_credentials_fail_at_once_naming_the_field(s3env: dict[str, str], bucket: str, checkpoint: Path) -> None:
    """RGW checks every signature: a wrong secret or an unknown access key is refused at the first request, not
    retried, and the error names the credentials field to fix."""
    cases = [
        ({"AWS_SECRET_ACCESS_KEY": "not-the-secret-key"}, "SignatureDoesNotMatch", "aws_secret_access_key"),
        ({"AWS_ACCESS_KEY_ID": "GPUFERRYNOSUCHKEY000"}, "InvalidAccessKeyId", "aws_access_key_id"),
    ]
    for wrong, code, field in cases:
        store = S3CheckpointStore(
            bucket=S3Bucket(bucket_name=bucket, credentials=_credentials({**s3env, **wrong}, s3env["S3_ENDPOINT_URL"]))
        )
        wire = Wire(store.client())
        try:
            with pytest.raises(ConfigurationError, match=rf"{code}: .*fix bucket\.credentials\.{field}") as put:
                store.put(checkpoint, "m/r")
            assert len(wire.sent()) == 1, wire.sent()  # refused at once: no retry, no body sent
            with pytest.raises(ConfigurationError, match=rf"{code}: .*bucket\.credentials\.{field}") as get:
                store.get(store.uri_of("m/r"), "/nonexistent/never-written")
            assert len(wire.sent()) == 2
        finally:
            wire.close()
        assert not is_transient(put.value) and not is_transient(get.value)


def test_bucket_names_are_checked(s3env: dict[str, str], checkpoint: Path) -> None:
    credentials = _credentials(s3env, s3env["S3_ENDPOINT_URL"])
    with pytest.raises(ValueError, match=r"bucket.bucket_name 's3://models/x' is not a bucket name \(give the name"):
        S3CheckpointStore(bucket=S3Bucket(bucket_name="s3://models/x", credentials=credentials))
    # A name of characters some stores allow, which RGW (like AWS for new buckets) refuses; RGW answers requests
    # into such a bucket with NoSuchBucket (InvalidBucketName only to CreateBucket).
    refused = S3CheckpointStore(bucket=S3Bucket(bucket_name="Bad_Name", credentials=credentials))
    with pytest.raises(ConfigurationError, match="(NoSuchBucket|InvalidBucketName): .* fix bucket.bucket_name") as info:
        refused.put(checkpoint, "m/r")
    assert not is_transient(info.value)


def test_https_with_the_stacks_ca(
    s3env: dict[str, str], bucket: str, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over https RGW 16 refuses botocore's default aws-chunked trailers; the store sends none (it signs every body
    instead), and trusts a private CA through the block's own field, with no environment variable."""

    def over_https(**client_parameters: object) -> S3CheckpointStore:
        credentials = AwsCredentials(
            aws_access_key_id=s3env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=s3env["AWS_SECRET_ACCESS_KEY"],
            region_name=s3env["AWS_DEFAULT_REGION"],
            aws_client_parameters=AwsClientParameters(endpoint_url=s3env["S3_HTTPS_ENDPOINT_URL"], **client_parameters),
        )
        return S3CheckpointStore(
            bucket=S3Bucket(bucket_name=bucket, credentials=credentials),
            multipart_threshold_mib=5,
            multipart_chunksize_mib=5,
            download_chunksize_mib=5,
        )

    for name in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)  # the CA comes from the block alone
    store = over_https(verify_cert_path=s3env["S3_CA_BUNDLE"])
    wire = Wire(store.client())
    try:
        ref = store.put(checkpoint, _unique("tls"))
    finally:
        wire.close()
    bodies = [h for (op, *_), h in zip(wire.requests, wire.headers, strict=True) if op in ("PutObject", "UploadPart")]
    assert len(bodies) == 3 + 3 + 1  # model.pt in 3 parts; 2 shards and metrics.json whole; the manifest
    assert not any("aws-chunked" in h.get("content-encoding", "") or "x-amz-trailer" in h for h in bodies)
    assert all(re.fullmatch("[0-9a-f]{64}", h["x-amz-content-sha256"]) for h in bodies), bodies  # signed, on https too
    out = store.get(ref.uri, tmp_path / "out")
    for entry in build_manifest(checkpoint)["files"]:
        assert (out / entry["path"]).read_bytes() == (checkpoint / entry["path"]).read_bytes()

    with pytest.raises(
        ConfigurationError,
        match="TLS certificate is not trusted .* set bucket.credentials.aws_client_parameters.verify_cert_path",
    ) as info:
        over_https().get(ref.uri, tmp_path / "never")
    assert not is_transient(info.value)


def test_where_the_stand_in_differs_from_aws(s3env: dict[str, str], bucket: str) -> None:
    """What README says of Ceph RGW 16.2 against AWS S3, and what the store does about each."""

    def plain(endpoint: str, **config: object) -> object:
        return boto3.client(
            "s3",
            endpoint_url=endpoint,
            verify=s3env["S3_CA_BUNDLE"],
            region_name=s3env["AWS_DEFAULT_REGION"],
            aws_access_key_id=s3env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=s3env["AWS_SECRET_ACCESS_KEY"],
            config=Config(retries={"max_attempts": 1}, **config),
        )

    http, https = plain(s3env["S3_ENDPOINT_URL"]), plain(s3env["S3_HTTPS_ENDPOINT_URL"])
    # botocore's default over https, a CRC32 trailer in an aws-chunked body, is refused (the store sends none).
    with pytest.raises(Exception, match="MissingContentLength"):
        https.put_object(Bucket=bucket, Key="rgw/trailer", Body=b"x" * 1000)
    # A wrong CRC32 header is neither checked nor stored (the store signs every body's sha256 instead).
    http.put_object(Bucket=bucket, Key="rgw/crc", Body=b"x" * 1000, ChecksumCRC32="AAAAAA==")
    assert "ChecksumCRC32" not in http.get_object(Bucket=bucket, Key="rgw/crc", ChecksumMode="ENABLED")
    # CompleteMultipartUpload answers an empty ETag (the store reads the object back with HEAD).
    upload = http.create_multipart_upload(Bucket=bucket, Key="rgw/mp")["UploadId"]
    etag = http.upload_part(Bucket=bucket, Key="rgw/mp", UploadId=upload, PartNumber=1, Body=b"y" * 100)["ETag"]
    done = http.complete_multipart_upload(
        Bucket=bucket, Key="rgw/mp", UploadId=upload, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}
    )
    assert done.get("ETag", "").strip('"') == ""
    assert http.head_object(Bucket=bucket, Key="rgw/mp")["ETag"].endswith('-1"')
    # ListParts of an aborted upload: NoSuchKey, where AWS answers NoSuchUpload (the store takes both).
    upload = http.create_multipart_upload(Bucket=bucket, Key="rgw/aborted")["UploadId"]
    http.abort_multipart_upload(Bucket=bucket, Key="rgw/aborted", UploadId=upload)
    with pytest.raises(Exception, match="NoSuchKey"):
        http.list_parts(Bucket=bucket, Key="rgw/aborted", UploadId=upload)
    # An invalid bucket name: InvalidBucketName from CreateBucket only, NoSuchBucket from the rest.
    with pytest.raises(Exception, match="InvalidBucketName"):
        http.create_bucket(Bucket="Bad_Name")
    with pytest.raises(Exception, match="NoSuchBucket"):
        http.get_object(Bucket="Bad_Name", Key="x")


@contextmanager
def _damaged_first_attempt(client: object, part_number: int) -> Iterator[list[int]]:
    """Flip one byte of the body of UploadPart ``part_number`` on its first attempt only (after it was signed and
    its checksum computed, as a faulty link or proxy would)."""
    damaged: list[int] = []
    original: list[object] = []  # the body botocore made; every retry sends the same request object again

    def damage(request: object, **_: object) -> None:
        if f"partNumber={part_number}&" not in f"{urlsplit(request.url).query}&":
            return
        if not damaged:
            original.append(request.body)
            data = bytearray(request.body.read() if hasattr(request.body, "read") else request.body)
            data[len(data) // 2] ^= 0x01
            request.body = bytes(data)
            damaged.append(part_number)
        elif original:
            request.body = original.pop()
            if hasattr(request.body, "seek"):
                request.body.seek(0)

    client.meta.events.register("before-send.s3.UploadPart", damage)
    try:
        yield damaged
    finally:
        client.meta.events.unregister("before-send.s3.UploadPart", damage)


def test_a_body_damaged_on_the_way_is_refused_and_sent_again(
    s3env: dict[str, str], bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part damaged after it was signed (by a faulty link, proxy or memory). Every body is signed with its sha256,
    over https too, and RGW checks that: the part is refused, the error is transient, and the next attempt resumes
    the upload."""
    for name in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(12 * MiB))  # parts of 5, 5 and 2 MiB
    for endpoint in (s3env["S3_ENDPOINT_URL"], s3env["S3_HTTPS_ENDPOINT_URL"]):
        credentials = AwsCredentials(
            aws_access_key_id=s3env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=s3env["AWS_SECRET_ACCESS_KEY"],
            region_name=s3env["AWS_DEFAULT_REGION"],
            aws_client_parameters=AwsClientParameters(endpoint_url=endpoint, verify_cert_path=s3env["S3_CA_BUNDLE"]),
        )
        store = S3CheckpointStore(
            bucket=S3Bucket(bucket_name=bucket, credentials=credentials),
            max_concurrency=1,
            multipart_threshold_mib=5,
            multipart_chunksize_mib=5,
            download_chunksize_mib=5,
        )
        name = _unique("damaged")
        with (
            _damaged_first_attempt(store.client(), part_number=2) as damaged,
            pytest.raises(Exception, match="XAmzContentSHA256Mismatch") as refused,
        ):
            store.put(src, name)
        assert damaged == [2] and is_transient(refused.value), refused.value
        wire = Wire(store.client())
        try:
            ref = store.put(src, name)
        finally:
            wire.close()
        resent = sorted(part for _, _, part, _ in wire.sent("UploadPart"))
        assert resent in ([2], [2, 3]), (endpoint, resent)  # part 1 was kept (and 3 too, if it went before the stop)
        assert (store.get(ref.uri, tmp_path / name) / "model.pt").read_bytes() == (src / "model.pt").read_bytes()


# ---- a stalled gateway, stopped and started again ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """A radosgw of this test's own on the s3 stack's cluster (`scripts/s3.sh gateway`): the stack's own gateway,
    which other tests use, is never stopped. Buckets, objects and pending uploads live in the cluster, so a new
    gateway process on the same port carries on where a stopped one left off."""

    def __init__(self, log: Path) -> None:
        self.port, self.name, self.log = _free_port(), f"t{uuid.uuid4().hex[:8]}", log
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["bash", str(REPO / "scripts" / "s3.sh"), "gateway", self.name, str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/", timeout=5) as answer:
                    if b"ListAllMyBucketsResult" in answer.read():
                        return
            except OSError:
                pass
            assert self.proc.poll() is None, f"the gateway exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no answer within 120 s: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def stall(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)  # it holds its connections and answers nothing

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # also ends a stopped process
            self.proc.wait(timeout=60)


@pytest.fixture
def gateway(tmp_path: Path, s3env: dict[str, str]) -> Iterator[Gateway]:
    own = Gateway(tmp_path / "gateway.log")
    own.start()
    try:
        yield own
    finally:
        own.kill()


def test_stalled_gateway_restarted_resumes_without_resending_finished_files_or_parts(
    gateway: Gateway, s3env: dict[str, str], bucket: str, tmp_path: Path
) -> None:
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])  # the stack's own gateway: it answers while ours is stopped
    src = tmp_path / "big"
    src.mkdir()
    size = 16 * MiB  # 4 parts of 5, 5, 5 and 1 MiB
    for i in range(6):
        (src / f"shard-{i}.bin").write_bytes(os.urandom(size))
    total = 6 * size
    name = _unique("resume")
    root = f"checkpoints/{name}"
    tuning = {"multipart_threshold_mib": 5, "multipart_chunksize_mib": 5, "max_concurrency": 2, "max_parallel_files": 1}
    # The client gives up quickly once the gateway stops answering.
    impatient = S3CheckpointStore(
        bucket=S3Bucket(
            bucket_name=bucket,
            credentials=_credentials(
                s3env,
                gateway.endpoint,
                connect_timeout=2,
                read_timeout=3,
                retries={"max_attempts": 1, "mode": "standard"},
            ),
        ),
        **tuning,
    )

    # Stall the gateway (SIGSTOP: it holds its connections and answers nothing) as the third file's third part
    # is sent: the first two files are stored by then (one file at a time), and one of the third file's first two
    # parts (part 3 waited for a free request thread).
    stalled = threading.Event()

    def stall(request: object, **_: object) -> None:
        if not stalled.is_set() and "/shard-2.bin?" in request.url and "partNumber=3&" in f"{request.url}&":
            gateway.stall()
            stalled.set()

    impatient.client().meta.events.register("before-send.s3.UploadPart", stall)
    try:
        with pytest.raises(Exception) as interrupted:
            impatient.put(src, name)
    finally:
        impatient.client().meta.events.unregister("before-send.s3.UploadPart", stall)
    assert stalled.is_set() and is_transient(interrupted.value), f"{interrupted.value!r} should be classified transient"
    gateway.kill()  # the stalled process ends, and with it whatever it had not stored; a new one takes its port
    # What the cluster holds now (read through the stack's own gateway).
    seen_files = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{root}/").get("Contents", [])}
    (upload,) = s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{root}/")["Uploads"]
    interrupted_key = upload["Key"]
    seen_parts = {
        p["PartNumber"]: p["Size"]
        for p in s3.list_parts(Bucket=bucket, Key=interrupted_key, UploadId=upload["UploadId"]).get("Parts", [])
    }
    assert seen_files == {f"{root}/shard-{i}.bin" for i in (0, 1)} and interrupted_key == f"{root}/shard-2.bin"
    assert seen_parts and 3 not in seen_parts, seen_parts
    gateway.start()
    # An upload of other content left under the checkpoint (another machine's attempt, say): never resumed.
    stale = s3.create_multipart_upload(Bucket=bucket, Key=f"{root}/shard-5.bin")
    s3.upload_part(
        Bucket=bucket, Key=f"{root}/shard-5.bin", UploadId=stale["UploadId"], PartNumber=1, Body=b"x" * (5 * MiB)
    )

    patient = S3CheckpointStore(
        bucket=S3Bucket(bucket_name=bucket, credentials=_credentials(s3env, gateway.endpoint)), **tuning
    )
    with pytest.raises(ChecksumMismatch, match="incomplete"):
        patient.read_manifest(patient.uri_of(name))  # no manifest: readers do not trust it yet
    wire = Wire(patient.client())
    try:
        resumed = patient.put(src, name)
    finally:
        wire.close()
    sent_keys = {key for _, key, _, _ in wire.sent("PutObject") + wire.sent("UploadPart")}
    assert not sent_keys & seen_files, "a finished file was sent again"
    # The interrupted file's upload was resumed, not begun again, and its finished parts were not sent again.
    assert interrupted_key not in {key for _, key, _, _ in wire.sent("CreateMultipartUpload")}
    resent = {part for _, key, part, _ in wire.sent("UploadPart") if key == interrupted_key}
    assert resent == {1, 2, 3, 4} - seen_parts.keys(), f"parts {resent} of {interrupted_key} sent"
    # Bytes counted at the wire: what the cluster did not hold, and what the store reports.
    assert wire.body_bytes() == total - len(seen_files) * size - sum(seen_parts.values())
    assert resumed.bytes_uploaded == wire.body_bytes()
    assert resumed.size_bytes == total and resumed.files == 6
    out = patient.get(resumed.uri, tmp_path / "out")
    for i in range(6):
        assert (out / f"shard-{i}.bin").read_bytes() == (src / f"shard-{i}.bin").read_bytes()
    assert patient.put(src, name).bytes_uploaded == 0
    # Unfinished uploads under the now complete checkpoint (the stale one) were aborted.
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{root}/").get("Uploads", []) == []


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
    (pending,) = (
        _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
        .list_multipart_uploads(Bucket=bucket, Prefix=key)
        .get("Uploads", [])
    )
    # Part 2 as stored no longer matches the local bytes (written over by someone else): it is sent again.
    _raw_client(s3env, s3env["S3_ENDPOINT_URL"]).upload_part(
        Bucket=bucket, Key=key, UploadId=pending["UploadId"], PartNumber=2, Body=os.urandom(5 * MiB)
    )

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
    assert (
        _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
        .list_multipart_uploads(Bucket=bucket, Prefix=key)
        .get("Uploads", [])
        == []
    )


def test_resume_of_an_upload_aborted_meanwhile_starts_afresh(
    store: S3CheckpointStore, tmp_path: Path, s3env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded upload was aborted since (by a lifecycle rule, say): ListParts answers NoSuchUpload on AWS,
    NoSuchKey on RGW 16; either way the file is sent again in a new upload."""
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(12 * MiB))
    name = _unique("model")
    client, bucket = store.client(), store.bucket.bucket_name
    real_upload_part = client.upload_part

    def fail_at_part_3(**kwargs: object) -> dict:
        if kwargs["PartNumber"] == 3:
            raise ConnectionResetError("connection reset by peer")
        return real_upload_part(**kwargs)

    with monkeypatch.context() as patched, pytest.raises(ConnectionResetError):
        patched.setattr(client, "upload_part", fail_at_part_3)
        store.put(src, name)
    s3 = _raw_client(s3env, s3env["S3_ENDPOINT_URL"])
    (pending,) = s3.list_multipart_uploads(Bucket=bucket, Prefix=f"checkpoints/{name}/").get("Uploads", [])
    s3.abort_multipart_upload(Bucket=bucket, Key=pending["Key"], UploadId=pending["UploadId"])
    wire = Wire(client)
    try:
        again = store.put(src, name)
    finally:
        wire.close()
    assert [op for op, *_ in wire.sent() if op in ("ListParts", "CreateMultipartUpload")] == [
        "ListParts",
        "CreateMultipartUpload",
    ]
    assert sorted(part for _, _, part, _ in wire.sent("UploadPart")) == [1, 2, 3]
    assert again.bytes_uploaded == 12 * MiB
    assert (store.get(again.uri, tmp_path / "out") / "model.pt").read_bytes() == (src / "model.pt").read_bytes()


def test_server_down_is_transient(s3env: dict[str, str], checkpoint: Path) -> None:
    down = S3CheckpointStore(
        bucket=S3Bucket(
            bucket_name="any",
            credentials=_credentials(
                s3env, f"http://127.0.0.1:{_free_port()}", connect_timeout=1, retries={"max_attempts": 1}
            ),
        ),
    )
    with pytest.raises(Exception) as info:
        down.put(checkpoint, "m/r")
    assert is_transient(info.value), repr(info.value)
