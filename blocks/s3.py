"""Checkpoints in S3 or any S3-compatible store (MinIO, Ceph, moto): verified, stored once, fast.

The layout is the one of ``LocalCheckpointStore``: ``s3://<bucket>/<bucket_folder>/<prefix>/<name>/``
holds the checkpoint's files and ``MANIFEST.json`` (path, size, sha256 of each file), written last;
readers trust only a checkpoint that has one.

Upload: each file is hashed (through the local hash cache, so an unchanged file is not read again),
then sent only if the stored object does not already carry the same sha256 (object metadata
``sha256``) and size, so storing an unchanged checkpoint moves 0 bytes and an interrupted upload
resumes without resending the files it finished. Large files go multipart, parts of several files in
flight at once. An interrupted multipart upload is resumed inside the file: this machine records each
multipart upload it starts (store, key, upload id, the file's sha256 and part size; S3 does not say
which content a pending upload was started for), and the next attempt at the same content lists the
upload's parts, keeps those whose ETag is the MD5 of the local bytes, sends the rest and completes it.
Other unfinished uploads under the checkpoint are aborted once it is complete. Each request carries
botocore's body checksum (CRC32; S3 and MinIO reject a body that does not match it, moto does not
check; multipart uploads declare it, as boto3's own do, so the store keeps it per part and for the
whole object) and every object is read back (HEAD: size and sha256) after its upload. A changed
checkpoint's old manifest is deleted before its first changed file is sent: readers never see a
manifest that does not match the files.

Download: every file is written to a temporary name, hashed, and renamed only when its sha256
matches the manifest; a mismatch raises ``ChecksumMismatch`` naming the object.

Point ``bucket.credentials.aws_client_parameters.endpoint_url`` at MinIO/Ceph for a
non-AWS store. Errors are the S3 client's own; ``tasks/retry.py`` decides which are transient.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect_aws import S3Bucket
from pydantic import Field

from blocks.checks import CheckRow, Probe
from blocks.errors import ChecksumMismatch, ConfigurationError, TransientError
from blocks.home import gpuferry_home
from blocks.specs import CheckpointRef
from blocks.storage import (
    MANIFEST,
    CheckpointStore,
    HashCache,
    checkpoint_files,
    checkpoint_ref,
    manifest_bytes,
    manifest_entry,
    manifest_from_entries,
    parse_manifest,
    sha256_file,
)

_MiB = 1 << 20
_MAX_PARTS = 10_000  # S3's limit on the parts of one upload
SHA256_METADATA = "sha256"  # stored as the object's x-amz-meta-sha256 header
_CONFIG_ERRORS = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix bucket.bucket_name",
    "AccessDenied": "access denied: check bucket.credentials and the bucket's policy",
    "InvalidAccessKeyId": "the access key is unknown to the store: fix bucket.credentials",
    "SignatureDoesNotMatch": "the secret key is wrong: fix bucket.credentials",
    "AllAccessDisabled": "all access to the bucket is disabled: fix bucket.bucket_name",
}
_CLIENT_LOCK = threading.Lock()


@lru_cache(maxsize=8)
def _s3_client(credentials: Any, max_pool_connections: int) -> Any:
    """One client per credentials and pool size (clients are thread-safe; creating one is not)."""
    from botocore.config import Config

    with _CLIENT_LOCK:
        params = credentials.aws_client_parameters.get_params_override()
        config = params.pop("config", None) or Config()
        # One pooled connection per transfer thread, or threads queue for connections.
        params["config"] = config.merge(Config(max_pool_connections=max_pool_connections))
        if getattr(credentials, "region_name", None):
            params["region_name"] = credentials.region_name
        return credentials.get_boto3_session().client("s3", **params)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key/prefix`` → (bucket, key prefix without a trailing slash)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigurationError(f"{uri!r} is not an S3 checkpoint URI (s3://<bucket>/<key>)")
    return parsed.netloc, parsed.path.strip("/")


class S3CheckpointStore(CheckpointStore):
    """Checkpoints in an S3 bucket (AWS S3, MinIO, Ceph or any S3-compatible store)."""

    _block_type_name = "gpuferry S3 Checkpoint Store"
    _description = (
        "Stores checkpoints, with a sha256 manifest written last, in an S3 or S3-compatible bucket; "
        "unchanged files are not sent again."
    )

    bucket: S3Bucket = Field(
        description="The bucket (prefect-aws S3 Bucket block). Its credentials' client parameters carry the "
        "endpoint URL for MinIO, Ceph or another S3-compatible store.",
    )
    multipart_threshold_mib: int = Field(
        64, ge=5, le=5 * 1024, description="Files at least this large (MiB) are uploaded in parts."
    )
    multipart_chunksize_mib: int = Field(
        16, ge=5, le=5 * 1024, description="Size of one part (MiB) of a multipart upload."
    )
    max_concurrency: int = Field(
        10, ge=1, le=128, description="Parts (of all files together) in flight at once."
    )
    max_parallel_files: int = Field(
        4, ge=1, le=64, description="Files hashed, checked and transferred at the same time."
    )
    download_chunksize_mib: int = Field(
        64, ge=5, le=5 * 1024,
        description="Size of one ranged GET (MiB) when downloading; larger files are fetched in ranges.",
    )  # fmt: skip

    # ---- clients and keys ----

    def client(self) -> Any:
        return _s3_client(self.bucket.credentials, self.max_concurrency + self.max_parallel_files + 2)

    def _checkpoint_key(self, name: str) -> str:
        parts = [self.bucket.bucket_folder.strip("/"), self.prefix.strip("/"), self.check_checkpoint_name(name)]
        return "/".join(p for p in parts if p)

    def uri_of(self, name: str) -> str:
        return f"s3://{self.bucket.bucket_name}/{self._checkpoint_key(name)}"

    def _download_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.download_chunksize_mib * _MiB,
            multipart_chunksize=self.download_chunksize_mib * _MiB,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

    # ---- the store ----

    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        source = Path(local_dir)
        bucket, root = self.bucket.bucket_name, self._checkpoint_key(name)
        files = checkpoint_files(source)
        client = self.client()
        cache, journal = HashCache(), UploadJournal(client.meta.endpoint_url, bucket)
        manifest_key = f"{root}/{MANIFEST}"
        with _explained(bucket, manifest_key):
            old_manifest = _read_object(client, bucket, manifest_key)
        invalidate = _Once(lambda: client.delete_object(Bucket=bucket, Key=manifest_key) if old_manifest else None)

        requests = _RequestPool(self.max_concurrency)
        # One file hashed at a time: the first file's parts go out after ITS hash, not after the hashes of
        # every file in flight, and later files are hashed while earlier ones upload.
        hashing = threading.Lock()

        def store_one(path: Path) -> tuple[dict, int]:
            with hashing:
                entry = manifest_entry(source, path, cache)
            key = f"{root}/{entry['path']}"
            with _explained(bucket, key):
                if _matches(_head(client, bucket, key), entry["size"], entry["sha256"]):
                    return entry, 0
                invalidate()  # the stored checkpoint is about to change: readers must not trust it
                if entry["size"] >= self.multipart_threshold_mib * _MiB:
                    sent = self._put_multipart(client, requests, journal, path, key, entry)
                else:
                    sent = requests.submit(_put_small, client, bucket, key, path, entry).result()
                stored = _head(client, bucket, key)
            if not _matches(stored, entry["size"], entry["sha256"]):
                raise ChecksumMismatch(
                    f"s3://{bucket}/{key}: after the upload the store reports {_describe(stored)}, "
                    f"expected {entry['size']} bytes with sha256 {entry['sha256']}"
                )
            return entry, sent

        try:
            results = _parallel(store_one, files, self.max_parallel_files)
        finally:
            requests.shutdown(wait=True, cancel_futures=True)

        manifest = manifest_from_entries([entry for entry, _ in results])
        raw = manifest_bytes(manifest)
        if raw != old_manifest:
            with _explained(bucket, manifest_key):
                digest = hashlib.sha256(raw).hexdigest()
                client.put_object(
                    Bucket=bucket, Key=manifest_key, Body=raw, ContentType="application/json",
                    Metadata={SHA256_METADATA: digest},
                )  # fmt: skip
                if not _matches(_head(client, bucket, manifest_key), len(raw), digest):
                    raise ChecksumMismatch(f"s3://{bucket}/{manifest_key}: the stored manifest does not match")
        with _explained(bucket, root):
            _abort_leftover_uploads(client, bucket, root)
        return checkpoint_ref(f"s3://{bucket}/{root}", raw, manifest, sum(moved for _, moved in results))

    def _put_multipart(
        self, client: Any, requests: _RequestPool, journal: UploadJournal, path: Path, key: str, entry: dict
    ) -> int:
        """Upload ``path`` in parts, resuming this content's unfinished upload if there is one; returns bytes sent."""
        bucket, size = self.bucket.bucket_name, entry["size"]
        part_size = max(self.multipart_chunksize_mib * _MiB, -(-size // _MAX_PARTS))
        upload_id, stored = None, {}
        pending = journal.get(key)
        if pending and (pending["sha256"], pending["part_size"]) == (entry["sha256"], part_size):
            try:
                stored = _listed_parts(client, bucket, key, pending["upload_id"])
                upload_id = pending["upload_id"]
            except Exception as exc:
                if _error_code(exc) != "NoSuchUpload":  # aborted or expired meanwhile: start again
                    raise
        if upload_id is None:
            upload_id = client.create_multipart_upload(
                Bucket=bucket, Key=key, Metadata={SHA256_METADATA: entry["sha256"]}, ChecksumAlgorithm="CRC32"
            )["UploadId"]
            journal.record(key, upload_id, entry["sha256"], part_size)

        with open(path, "rb") as f:

            def send(number: int) -> tuple[dict, int]:
                offset = (number - 1) * part_size
                body = os.pread(f.fileno(), min(part_size, size - offset), offset)
                done = stored.get(number)
                if done and done["ETag"].strip('"') == hashlib.md5(body, usedforsecurity=False).hexdigest():
                    return _completed_part(number, done), 0  # already stored by an earlier attempt
                sent = client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body, ChecksumAlgorithm="CRC32"
                )
                return _completed_part(number, sent), len(body)

            parts = _results(requests.submit_all(send, range(1, -(-size // part_size) + 1)))
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [part for part, _ in parts]}
        )
        journal.forget(key)
        return sum(sent for _, sent in parts)

    def get(self, uri: str, dest: str | Path) -> Path:
        bucket, root = parse_s3_uri(uri)
        client = self.client()
        manifest = self.read_manifest(uri)
        out = Path(dest)

        from boto3.s3.transfer import create_transfer_manager

        with create_transfer_manager(client, self._download_config()) as transfers:

            def fetch_one(entry: dict) -> None:
                key = f"{root}/{entry['path']}"
                target = out / entry["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.partial")
                try:
                    with _explained(bucket, key):
                        transfers.download(bucket, key, str(partial)).result()
                    actual = sha256_file(partial)
                    if actual != entry["sha256"]:
                        raise ChecksumMismatch(
                            f"s3://{bucket}/{key}: sha256 {actual} but the manifest says {entry['sha256']} "
                            f"(the stored object is corrupt: store the checkpoint again)"
                        )
                    os.replace(partial, target)
                finally:
                    partial.unlink(missing_ok=True)

            _parallel(fetch_one, manifest["files"], self.max_parallel_files)
        return out

    def read_manifest(self, uri: str) -> dict:
        """The checkpoint's manifest; ``ChecksumMismatch`` when it has none (its upload did not finish)."""
        bucket, root = parse_s3_uri(uri)
        key = f"{root}/{MANIFEST}"
        with _explained(bucket, key):
            raw = _read_object(self.client(), bucket, key)
        if raw is None:
            raise ChecksumMismatch(
                f"{uri} has no {MANIFEST}: the checkpoint is incomplete (its upload did not finish)"
            )
        return parse_manifest(raw, uri)

    def _read_bytes(self, uri: str, path: str) -> bytes | None:
        bucket, root = parse_s3_uri(uri)
        key = f"{root}/{path}"
        with _explained(bucket, key):
            return _read_object(self.client(), bucket, key)

    def delete(self, uri: str) -> int:
        """Delete a stored checkpoint (its manifest first, so readers stop trusting it); returns objects deleted."""
        bucket, root = parse_s3_uri(uri)
        client = self.client()
        deleted = 0
        with _explained(bucket, root):
            client.delete_object(Bucket=bucket, Key=f"{root}/{MANIFEST}")
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/"):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                    deleted += len(keys)
        return deleted


# ---- helpers ----------------------------------------------------------------------------------

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The endpoint, the bucket, and a probe object put, read back and deleted (``blocks/check_services.py``)."""
        from blocks.check_services import check_s3

        check_s3(self, probe)
        return probe.rows


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


class _explained:
    """Configuration errors of the store (no bucket, bad credentials) become ConfigurationError, naming the
    field to fix; everything else propagates as the client raised it."""

    def __init__(self, bucket: str, key: str) -> None:
        self.where = f"s3://{bucket}/{key}"

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        if exc is None:
            return
        code = _error_code(exc)
        if code in _CONFIG_ERRORS:
            raise ConfigurationError(f"{self.where}: {code}: {_CONFIG_ERRORS[code]}") from exc
        if type(exc).__name__ == "RetriesExceededError":  # s3transfer's download gave up; it keeps no __cause__
            last = getattr(exc, "last_exception", None)
            raise TransientError(f"{self.where}: the download failed after retries: {last!r}") from last


def _read_object(client: Any, bucket: str, key: str) -> bytes | None:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise


def _head(client: Any, bucket: str, key: str) -> dict | None:
    try:
        return client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _put_small(client: Any, bucket: str, key: str, path: Path, entry: dict) -> int:
    with open(path, "rb") as body:
        client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={SHA256_METADATA: entry["sha256"]})
    return entry["size"]


def _listed_parts(client: Any, bucket: str, key: str, upload_id: str) -> dict[int, dict]:
    """Part number → the part (ETag, checksum) of the parts an unfinished multipart upload already holds."""
    pages = client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id)
    return {part["PartNumber"]: part for page in pages for part in page.get("Parts", [])}


def _completed_part(number: int, part: dict) -> dict:
    """A part as CompleteMultipartUpload takes it: its ETag and, where the store keeps one, its CRC32."""
    return {"PartNumber": number, **{k: part[k] for k in ("ETag", "ChecksumCRC32") if part.get(k)}}


class UploadJournal:
    """The multipart uploads this machine started into one bucket and has not completed, and for which content.

    ListMultipartUploads shows neither an upload's metadata nor a checksum of the whole, so without this record
    an upload begun for other content (whose ``sha256`` metadata the completed object would carry) could not be
    told apart. One small JSON file per (endpoint, bucket, key) under ``$GPUFERRY_HOME/cache/s3-uploads``.
    """

    def __init__(self, endpoint: str, bucket: str, root: Path | None = None) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.root = root if root is not None else gpuferry_home() / "cache" / "s3-uploads"

    def _path(self, key: str) -> Path:
        where = "\n".join((self.endpoint, self.bucket, key))
        return self.root / f"{hashlib.sha256(where.encode()).hexdigest()}.json"

    def get(self, key: str) -> dict | None:
        try:
            record = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and {"upload_id", "sha256", "part_size"} <= record.keys() else None

    def record(self, key: str, upload_id: str, sha256: str, part_size: int) -> None:
        path = self._path(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "upload_id": upload_id, "sha256": sha256, "part_size": part_size}))
            os.replace(tmp, path)
        except OSError:
            pass  # without the record a later attempt sends the whole file again: slower, still correct

    def forget(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def _abort_leftover_uploads(client: Any, bucket: str, root: str) -> int:
    """Abort the unfinished multipart uploads under a checkpoint whose every file is now stored.

    They are what interrupted attempts left behind (the store keeps, and bills, their parts until they
    are aborted). Two processes storing the same checkpoint name at once is not supported.
    """
    aborted = 0
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=f"{root}/"):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
    return aborted


def _matches(head: dict | None, size: int, sha256: str) -> bool:
    return (
        head is not None
        and head.get("ContentLength") == size
        and head.get("Metadata", {}).get(SHA256_METADATA) == sha256
    )


def _describe(head: dict | None) -> str:
    if head is None:
        return "no object"
    return f"{head.get('ContentLength')} bytes with sha256 {head.get('Metadata', {}).get(SHA256_METADATA)}"


class _Once:
    """Call ``fn`` at most once, from whichever thread gets there first."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn, self._done, self._lock = fn, False, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if not self._done:
                self._fn()
                self._done = True


class _RequestPool(ThreadPoolExecutor):
    """The requests (parts and small files) of every file of one upload, ``workers`` in flight at once. A file's
    parts are queued together, so files finish one after another, each completed while the next one's parts are
    sent, rather than all at the end."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="gpuferry-s3-request")
        self._queueing = threading.Lock()

    def submit_all(self, fn: Callable[[Any], Any], items: Any) -> list[Future]:
        with self._queueing:
            return [self.submit(fn, item) for item in items]


def _results(futures: list[Future]) -> list:
    """The futures' results in order; on the first error the ones not started are cancelled, the running ones
    awaited, and the error raised."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def _parallel(fn: Callable[[Any], Any], items: list, workers: int) -> list:
    """``fn`` over ``items`` in threads, results in order; the first error is raised after all stop."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="gpuferry-s3") as pool:
        return _results([pool.submit(fn, item) for item in items])
