"""Verified download of a stored checkpoint from S3 or any S3-compatible store (MinIO, Ceph RGW).

Needs the standard library and a boto3 S3 client only, so the inference server can use it as gpuferry's
S3 checkpoint store does (``blocks/s3.py``): the same reads, the same checks.

The checkpoint's ``MANIFEST.json`` (``runtime/contract.py``) is read first; a checkpoint without one, or
with one that is not a gpuferry manifest or names a path outside the checkpoint, is refused before
anything is written. Each listed file is fetched in ranged GETs (several in flight, of several files
at once), written in place into ``.<name>.partial`` and hashed in order while its later ranges still
arrive; it gets its own name only when its size and sha256 match the manifest. Every ranged answer must
report the object's size as the manifest does. A range whose stream breaks is fetched again (a few
times); any other error stops the download, and no file that was not verified keeps its name.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from runtime import contract

_MiB = 1 << 20
_RANGE_ATTEMPTS = 5  # as s3transfer's download retries
_HASH_PIECE = 8 * _MiB


class UnverifiedCheckpoint(Exception):
    """The checkpoint has no manifest, or a file that is missing or does not match it."""


def fetch_checkpoint(
    client: Any,
    bucket: str,
    prefix: str,
    dest: str | Path,
    *,
    chunk_size: int = 64 * _MiB,
    max_concurrency: int = 10,
    paths: Iterable[str] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Download the checkpoint at ``s3://bucket/prefix/`` into ``dest``; return its manifest (raw bytes, parsed).

    ``paths`` limits the download to those files of the manifest (each must be listed). ``chunk_size`` is
    the size of one ranged GET, ``max_concurrency`` the GETs in flight (of as many files as that takes).
    """
    root = prefix.strip("/")
    where = f"s3://{bucket}/{root}"
    raw = read_manifest(client, bucket, root)
    try:
        manifest = contract.parse_manifest(raw, where)
    except contract.ManifestError as exc:
        raise UnverifiedCheckpoint(str(exc)) from None
    entries = manifest["files"]
    if paths is not None:
        wanted = set(paths)
        unknown = wanted - {entry["path"] for entry in entries}
        if unknown:
            raise UnverifiedCheckpoint(f"{where}/{contract.MANIFEST_FILENAME} does not list {sorted(unknown)}")
        entries = [entry for entry in entries if entry["path"] in wanted]
    out = Path(dest)
    with ThreadPoolExecutor(max_concurrency, thread_name_prefix="fetch-range") as ranges:

        def one(entry: dict[str, Any]) -> None:
            key = f"{root}/{entry['path']}" if root else entry["path"]
            _fetch_file(client, ranges, bucket, key, entry, out / entry["path"], chunk_size)

        if len(entries) <= 1 or max_concurrency <= 1:
            for entry in entries:
                one(entry)
        else:  # a thread per file waits for its ranges in order and hashes them
            with ThreadPoolExecutor(min(max_concurrency, len(entries)), thread_name_prefix="fetch-file") as files:
                _all([files.submit(one, entry) for entry in entries])
    return raw, manifest


def read_manifest(client: Any, bucket: str, root: str) -> bytes:
    """The raw ``MANIFEST.json`` of the checkpoint at ``s3://bucket/root``; ``UnverifiedCheckpoint`` without one."""
    key = f"{root}/{contract.MANIFEST_FILENAME}" if root else contract.MANIFEST_FILENAME
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _error_code(exc) in ("NoSuchKey", "404"):
            raise UnverifiedCheckpoint(
                f"s3://{bucket}/{root} has no {contract.MANIFEST_FILENAME}: the checkpoint is incomplete "
                "(its upload did not finish, or no gpuferry checkpoint store wrote it); refusing it"
            ) from None
        raise


def _fetch_file(
    client: Any, ranges: ThreadPoolExecutor, bucket: str, key: str, entry: dict[str, Any], target: Path, chunk: int
) -> None:
    where = f"s3://{bucket}/{key}"
    size = entry["size"]
    spans = [(start, min(size, start + chunk)) for start in range(0, size, chunk)] or [(0, 0)]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        futures = [ranges.submit(_fetch_range, client, bucket, key, fd, start, end, size) for start, end in spans]
        digest = hashlib.sha256()
        try:
            # Hash in order as the ranges land: the last range's bytes are the only ones hashed after the download.
            for (start, end), future in zip(spans, futures):
                future.result()
                for offset in range(start, end, _HASH_PIECE):
                    digest.update(os.pread(fd, min(_HASH_PIECE, end - offset), offset))
        except BaseException:
            _stop(futures)
            raise
        actual = digest.hexdigest()
        if actual != entry["sha256"]:
            raise UnverifiedCheckpoint(
                f"{where}: sha256 {actual} but the manifest says {entry['sha256']} ({size} bytes): the stored "
                "object is corrupt or was changed after the checkpoint was stored; store the checkpoint again"
            )
        os.replace(partial, target)
    finally:
        os.close(fd)
        partial.unlink(missing_ok=True)


def _fetch_range(client: Any, bucket: str, key: str, fd: int, start: int, end: int, size: int) -> None:
    """Write bytes [start, end) of the object at their place in ``fd``, checking the size the store reports."""
    where = f"s3://{bucket}/{key}"
    retryable = _stream_errors()
    for attempt in range(1, _RANGE_ATTEMPTS + 1):
        try:
            request = {"Bucket": bucket, "Key": key}
            if end > start:  # an empty object has no range to ask for
                request["Range"] = f"bytes={start}-{end - 1}"
            response = client.get_object(**request)
            total = _object_size(response)
            if total != size:
                raise UnverifiedCheckpoint(f"{where}: the store holds {total} bytes but the manifest says {size}")
            offset = start
            for piece in response["Body"].iter_chunks(_MiB):
                os.pwrite(fd, piece, offset)
                offset += len(piece)
            if offset != end:
                raise UnverifiedCheckpoint(f"{where}: got bytes {start}-{offset} of {start}-{end}")
            return
        except retryable:
            if attempt == _RANGE_ATTEMPTS:
                raise
        except Exception as exc:
            code = _error_code(exc)
            if code in ("NoSuchKey", "404"):
                raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
            if code == "InvalidRange":
                raise UnverifiedCheckpoint(f"{where}: smaller than the {size} bytes the manifest says") from None
            raise


def _object_size(response: dict[str, Any]) -> int | None:
    content_range = response.get("ContentRange")  # "bytes 0-99/1234"
    if content_range:
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    return response.get("ContentLength")


def _stream_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    return (socket.timeout, ConnectionError, ReadTimeoutError, IncompleteReadError, ResponseStreamingError,
            ConnectionClosedError)  # fmt: skip


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def _stop(futures: list[Future]) -> None:
    for future in futures:
        future.cancel()
    wait(futures)


def _all(futures: list[Future]) -> None:
    """Wait for every future; on the first error cancel those not started, await the rest, raise it."""
    try:
        for future in futures:
            future.result()
    except BaseException:
        _stop(futures)
        raise
