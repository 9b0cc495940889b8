"""Store a checkpoint directory in S3: its files, then ``MANIFEST.json`` last; unchanged files not sent again.

Used by gpuferry's ``S3CheckpointStore`` on the orchestrator (``blocks/storage/s3.py``) and by ``python -m
runtime.store`` on a cluster that wrote the checkpoint: the same requests and the same checks wherever it runs.
boto3/botocore, the standard library and ``runtime`` only.

Each file is hashed (through the hash cache: an unchanged file is not read again), then sent only if the stored
object does not already carry the same sha256 (object metadata ``sha256``) and size. Large files go multipart,
parts of several files in flight at once. An interrupted multipart upload is resumed inside the file: the machine
that starts one records it (``UploadJournal``: key, upload id, the file's sha256 and part size; S3 does not say which
content a pending upload was started for), and the next attempt at the same content lists the upload's parts, keeps
those whose ETag is the MD5 of the local bytes, sends the rest and completes it. Other unfinished uploads under the
checkpoint are aborted once it is complete. Every object is read back (HEAD: size and sha256) after its upload. A
changed checkpoint's old manifest is deleted before its first changed file is sent: readers never see a manifest
that does not match the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.contract import MANIFEST_FILENAME, manifest_bytes
from runtime.manifest import HashCache, checkpoint_files, default_cache_root, manifest_entry, manifest_from_entries
from runtime.s3_errors import error_code

_MAX_PARTS = 10_000  # S3's limit on the parts of one upload
SHA256_METADATA = "sha256"  # stored as the object's x-amz-meta-sha256 header


class StoredMismatch(Exception):
    """After an upload the store holds something else than what was sent."""


@dataclass(frozen=True)
class UploadSettings:
    multipart_threshold: int = 64 << 20  # files at least this large (bytes) go in parts
    part_size: int = 16 << 20
    max_concurrency: int = 10  # requests (parts and small files) in flight at once
    max_parallel_files: int = 4  # files hashed, checked and uploaded at the same time


Explain = Callable[[str, str], AbstractContextManager[None]]  # (bucket, key) -> what to do with the store's errors


def _no_explanation(bucket: str, key: str) -> AbstractContextManager[None]:
    return nullcontext()


def put_directory(
    client: Any,
    bucket: str,
    root: str,
    source: Path,
    settings: UploadSettings,
    *,
    cache: HashCache,
    journal: UploadJournal,
    explained: Explain = _no_explanation,
) -> tuple[bytes, dict, int]:
    """Store the files of ``source`` under ``s3://bucket/root/`` and its manifest last; returns the manifest's bytes,
    the manifest, and the bytes sent. ``explained(bucket, key)`` wraps each request (the caller's error mapping)."""
    files = checkpoint_files(source)
    manifest_key = f"{root}/{MANIFEST_FILENAME}"
    with explained(bucket, manifest_key):
        old_manifest = read_object(client, bucket, manifest_key)
    invalidate = Once(lambda: client.delete_object(Bucket=bucket, Key=manifest_key) if old_manifest else None)

    requests = RequestPool(settings.max_concurrency)
    # One file hashed at a time: the first file's parts go out after ITS hash, not after the hashes of
    # every file in flight, and later files are hashed while earlier ones upload.
    hashing = threading.Lock()

    def store_one(path: Path) -> tuple[dict, int]:
        with hashing:
            entry = manifest_entry(source, path, cache)
        key = f"{root}/{entry['path']}"
        with explained(bucket, key):
            if _matches(_head(client, bucket, key), entry["size"], entry["sha256"]):
                return entry, 0
            invalidate()  # the stored checkpoint is about to change: readers must not trust it
            if entry["size"] >= settings.multipart_threshold:
                sent = _put_multipart(client, bucket, requests, journal, path, key, entry, settings.part_size)
            else:
                sent = requests.submit(_put_small, client, bucket, key, path, entry).result()
            stored = _head(client, bucket, key)
        if not _matches(stored, entry["size"], entry["sha256"]):
            raise StoredMismatch(
                f"s3://{bucket}/{key}: after the upload the store reports {_describe(stored)}, "
                f"expected {entry['size']} bytes with sha256 {entry['sha256']}"
            )
        return entry, sent

    try:
        stored_files = parallel(store_one, files, settings.max_parallel_files)
    finally:
        requests.shutdown(wait=True, cancel_futures=True)

    manifest = manifest_from_entries([entry for entry, _ in stored_files])
    raw = manifest_bytes(manifest)
    if raw != old_manifest:
        with explained(bucket, manifest_key):
            digest = hashlib.sha256(raw).hexdigest()
            client.put_object(
                Bucket=bucket,
                Key=manifest_key,
                Body=raw,
                ContentType="application/json",
                Metadata={SHA256_METADATA: digest},
            )
            if not _matches(_head(client, bucket, manifest_key), len(raw), digest):
                raise StoredMismatch(f"s3://{bucket}/{manifest_key}: the stored manifest does not match")
    with explained(bucket, root):
        abort_leftover_uploads(client, bucket, root)
    return raw, manifest, sum(moved for _, moved in stored_files)


def _put_small(client: Any, bucket: str, key: str, path: Path, entry: dict) -> int:
    with open(path, "rb") as body:
        client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={SHA256_METADATA: entry["sha256"]})
    return entry["size"]


def _put_multipart(
    client: Any,
    bucket: str,
    requests: RequestPool,
    journal: UploadJournal,
    path: Path,
    key: str,
    entry: dict,
    chunk: int,
) -> int:
    """Upload ``path`` in parts, resuming this content's unfinished upload if there is one; returns bytes sent."""
    size = entry["size"]
    part_size = max(chunk, -(-size // _MAX_PARTS))
    upload_id, stored = None, {}
    pending = journal.get(key)
    if pending and (pending["sha256"], pending["part_size"]) == (entry["sha256"], part_size):
        try:
            stored = listed_parts(client, bucket, key, pending["upload_id"])
            upload_id = pending["upload_id"]
        except Exception as exc:
            if not upload_is_gone(exc):  # aborted or expired meanwhile: start again
                raise
    if upload_id is None:
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata={SHA256_METADATA: entry["sha256"]})[
            "UploadId"
        ]
        journal.record(key, upload_id, entry["sha256"], part_size)

    with open(path, "rb") as f:

        def send(number: int) -> tuple[dict, int]:
            offset = (number - 1) * part_size
            body = _read_part(f.fileno(), path, offset, min(part_size, size - offset))
            done = stored.get(number)
            if done and done["ETag"].strip('"') == md5_hex(body):
                return {"PartNumber": number, "ETag": done["ETag"]}, 0  # stored by an earlier attempt
            sent = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": sent["ETag"]}, len(body)

        parts = results(requests.submit_all(send, range(1, -(-size // part_size) + 1)))
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [part for part, _ in parts]}
    )
    journal.forget(key)
    return sum(sent for _, sent in parts)


_buffers = threading.local()


def _read_part(fd: int, path: Path, offset: int, length: int) -> bytearray:
    """Bytes [offset, offset + length) of the file, read into a buffer this thread reuses for its next part.

    botocore hashes a bytearray body (for the signature) and sends it as it is, in one piece; a ``bytes`` body it
    turns into a BytesIO, which it hashes in 1 MiB reads and sends in 16 KiB ones, each a copy. Reusing the buffer
    spares a fresh allocation (and its page faults) per part. (Without a file-like body botocore sends no
    ``Expect: 100-continue``: a refused part has been sent whole; parts are 16 MiB by default.)"""
    buffers = getattr(_buffers, "by_size", None)
    if buffers is None or (length not in buffers and len(buffers) >= 2):  # a part size and a file's last part
        buffers = _buffers.by_size = {}
    body = buffers.get(length)
    if body is None:
        body = buffers[length] = bytearray(length)
    view, done = memoryview(body), 0
    while done < length:
        read = os.preadv(fd, [view[done:]], offset + done)
        if read == 0:
            raise StoredMismatch(f"{path} got shorter while it was being stored: read it again once it is written")
        done += read
    return body


def read_object(client: Any, bucket: str, key: str) -> bytes | None:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise


def _head(client: Any, bucket: str, key: str) -> dict | None:
    try:
        return client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


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


# ---- multipart bookkeeping ---------------------------------------------------------------------


def md5_hex(body: bytes | bytearray | memoryview) -> str:
    return hashlib.md5(body, usedforsecurity=False).hexdigest()


def listed_parts(client: Any, bucket: str, key: str, upload_id: str) -> dict[int, dict]:
    """Part number → the part (ETag, size) of the parts an unfinished multipart upload already holds."""
    pages = client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id)
    return {part["PartNumber"]: part for page in pages for part in page.get("Parts", [])}


def upload_is_gone(exc: BaseException) -> bool:
    """ListParts' answer for an upload that was aborted or expired: ``NoSuchUpload`` on AWS and MinIO, ``NoSuchKey``
    on Ceph RGW 16."""
    return error_code(exc) in ("NoSuchUpload", "NoSuchKey")


class UploadJournal:
    """The multipart uploads this machine started into one bucket and has not completed, and for which content.

    ListMultipartUploads shows neither an upload's metadata nor a checksum of the whole, so without this record
    an upload begun for other content (whose ``sha256`` metadata the completed object would carry) could not be
    told apart. One small JSON file per (endpoint, bucket, key) under ``root`` (``$GPUFERRY_HOME/cache/s3-uploads``).
    """

    def __init__(self, endpoint: str, bucket: str, root: Path | None = None) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.root = root if root is not None else default_cache_root() / "s3-uploads"

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
        record = {"key": key, "upload_id": upload_id, "sha256": sha256, "part_size": part_size}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError:
            pass  # without the record a later attempt sends the whole file again: slower, still correct

    def forget(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def abort_leftover_uploads(client: Any, bucket: str, root: str) -> int:
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


# ---- pools ---------------------------------------------------------------------------------------


class Once:
    """Call ``fn`` at most once, from whichever thread gets there first."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn, self._done, self._lock = fn, False, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if not self._done:
                self._fn()
                self._done = True


class RequestPool(ThreadPoolExecutor):
    """The requests (parts and small files) of every file of one upload, ``workers`` in flight at once. A file's
    parts are queued together, so files finish one after another, each completed while the next one's parts are
    sent, rather than all at the end."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="gpuferry-s3-request")
        self._queueing = threading.Lock()

    def submit_all(self, fn: Callable[[Any], Any], items: Any) -> list[Future]:
        with self._queueing:
            return [self.submit(fn, item) for item in items]


def results(futures: list[Future]) -> list:
    """The futures' results in order; on the first error the ones not started are cancelled, the running ones
    awaited, and the error raised."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def parallel(fn: Callable[[Any], Any], items: list, workers: int) -> list:
    """``fn`` over ``items`` in threads, results in order; the first error is raised after all stop."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="gpuferry-s3") as pool:
        return results([pool.submit(fn, item) for item in items])
