"""Fetch a stored checkpoint into a local directory, every file checked against its manifest.

Model-agnostic: it imports only the standard library and ``runtime.contract`` (and boto3, for ``s3://`` only), so a
workload's own server can use it without MLflow::

    from runtime.checkpoint import UnverifiedCheckpoint, fetch_checkpoint

    checkpoint = fetch_checkpoint(os.environ["MODEL_URI"], "/tmp/model")  # raises when it cannot be trusted
    load_my_model(checkpoint.path)

A checkpoint is a directory that holds ``MANIFEST.json`` (format in ``runtime/contract.py``), written last by
gpuferry's checkpoint stores. Only the files it lists are fetched, each hashed as it is copied (one read) and
renamed into place only when its size and sha256 match; the manifest itself lands last. Files are copied even
from a local path, so what is loaded is exactly what was checked, whatever happens to the stored copy later.

From S3 (``fetch_s3``, which gpuferry's S3 checkpoint store uses too: the same reads, the same checks) each file
comes in ranged GETs, several in flight, of several files at once, written in place and hashed in file order: the
bytes that continue what is hashed are hashed as they arrive, those that land ahead are read back when the hash
reaches them. The GETs in flight are each file's earliest ranges first (every file's first range, then every file's
second...), so that most bytes land where their file's hash has reached and are not read back. Every answer must
report the object's size as the manifest does, and a range whose stream breaks is asked again from where it broke
(a few times).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

from runtime import contract

_CHUNK = 1 << 20
# One read of a range's stream, as s3transfer's io_chunksize: reads of 1 MiB cost the client about twice the kernel
# time for the same bytes (bench/s3_upload.py's P3; README).
_READ = 256 << 10
_RANGE = 64 << 20  # one ranged GET
_RANGE_ATTEMPTS = 5  # as s3transfer's download retries
_HASH_PIECE = 8 << 20


class UnverifiedCheckpoint(Exception):
    """The checkpoint has no manifest, or a file that does not match it: it must not be served."""


class NoManifest(UnverifiedCheckpoint):
    """Nothing is stored at the checkpoint's manifest: its upload did not finish, or no checkpoint store wrote it."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    path: Path  # the local directory holding the verified files (and a copy of the manifest)
    sha256: str  # of MANIFEST.json: the checkpoint's identity, as gpuferry records it in MLflow
    files: int
    size_bytes: int


def fetch_checkpoint(uri: str, dest: str | Path, expected_sha256: str | None = None) -> VerifiedCheckpoint:
    """Copy the checkpoint at ``uri`` (a path, ``file:///path`` or ``s3://bucket/prefix``) into ``dest``.

    ``expected_sha256``: the checkpoint's identity as the model version records it (``MODEL_SHA256``); a
    checkpoint whose manifest has another is refused before any file is fetched (it was replaced since).

    Raises ``UnverifiedCheckpoint`` when it has no manifest or a listed file is missing or differs from it,
    ``contract.ManifestError`` when the manifest is not one, ``FileNotFoundError`` when nothing is at ``uri``
    and ``ValueError`` for a URI of another kind. ``dest`` is created; files already in it are replaced.
    """
    parsed = urlparse(uri)
    target = Path(dest)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{uri}: an s3:// URI names a bucket (s3://bucket/prefix)")
        return _fetch_s3(parsed.netloc, parsed.path.strip("/"), target, expected_sha256)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: file:// URIs must name a local path (file:///path)")
        root = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        root = Path(uri)
    else:
        raise ValueError(f"{uri}: unsupported scheme {parsed.scheme!r} (use a path, file:// or s3://)")
    if root.is_file():
        raise ValueError(f"{uri} is a file: name the checkpoint directory, which holds {contract.MANIFEST_FILENAME}")
    if not root.is_dir():
        raise FileNotFoundError(f"{uri}: no checkpoint directory at {root}")
    try:
        raw = (root / contract.MANIFEST_FILENAME).read_bytes()
    except FileNotFoundError:
        raise NoManifest(_no_manifest(root)) from None
    _check_identity(raw, expected_sha256, str(root))
    files = contract.parse_manifest(raw, str(root))["files"]
    for entry in files:
        where = f"{root}/{entry['path']}"
        try:
            source = open(root / entry["path"], "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
        with source:
            _copy_checked(source, entry, target, where)
    return _finish(raw, files, target)


def _check_identity(raw: bytes, expected: str | None, where: str) -> None:
    actual = hashlib.sha256(raw).hexdigest()
    if expected and actual != expected:
        raise UnverifiedCheckpoint(
            f"{where}: its {contract.MANIFEST_FILENAME} has sha256 {actual}, but the model version records {expected}: "
            "the stored checkpoint is not the one that was registered; refusing to serve it"
        )


def _fetch_s3(bucket: str, prefix: str, target: Path, expected_sha256: str | None = None) -> VerifiedCheckpoint:
    raw, files = fetch_s3(s3_client(), bucket, prefix, target, expected_sha256=expected_sha256)
    return _finish(raw, files, target)


def fetch_s3(
    client: Any,
    bucket: str,
    prefix: str,
    dest: str | Path,
    *,
    chunk_size: int = _RANGE,
    max_concurrency: int = 10,
    expected_sha256: str | None = None,
) -> tuple[bytes, list[dict[str, Any]]]:
    """Fetch the files of the checkpoint at ``s3://bucket/prefix`` into ``dest`` with ``client`` (boto3), each checked;
    return the raw manifest and its entries (the manifest itself is not written). ``chunk_size`` is one ranged GET,
    ``max_concurrency`` the GETs in flight (of as many files as that takes). Raises as ``fetch_checkpoint``."""
    root = prefix.strip("/")
    raw = read_s3_manifest(client, bucket, root)
    _check_identity(raw, expected_sha256, f"s3://{bucket}/{root}".rstrip("/"))
    files = contract.parse_manifest(raw, f"s3://{bucket}/{root}".rstrip("/"))["files"]
    out = Path(dest)
    with _RangePool(max_concurrency) as ranges:

        def one(entry: dict[str, Any]) -> None:
            key = f"{root}/{entry['path']}" if root else entry["path"]
            _fetch_object(client, ranges, bucket, key, entry, out / entry["path"], chunk_size)

        if len(files) <= 1 or max_concurrency <= 1:
            for entry in files:
                one(entry)
        else:  # a thread per file waits for its ranges in order and hashes them
            with ThreadPoolExecutor(min(max_concurrency, len(files)), thread_name_prefix="fetch-file") as pool:
                _all([pool.submit(one, entry) for entry in files])
    return raw, files


def read_s3_manifest(client: Any, bucket: str, prefix: str) -> bytes:
    """The raw ``MANIFEST.json`` of the checkpoint at ``s3://bucket/prefix``; ``UnverifiedCheckpoint`` without one."""
    root = prefix.strip("/")
    try:
        key = f"{root}/{contract.MANIFEST_FILENAME}" if root else contract.MANIFEST_FILENAME
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _error_code(exc) in ("NoSuchKey", "404"):
            raise NoManifest(_no_manifest(f"s3://{bucket}/{root}".rstrip("/"))) from None
        raise


def _fetch_object(
    client: Any, ranges: _RangePool, bucket: str, key: str, entry: dict[str, Any], dest: Path, chunk: int
) -> None:
    where, size = f"s3://{bucket}/{key}", entry["size"]
    spans = [(start, min(size, start + chunk)) for start in range(0, size, chunk)] or [(0, 0)]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        digest = _InOrderDigest(fd)
        futures = [
            ranges.submit(rank, _fetch_range, client, bucket, key, digest, start, end, entry)
            for rank, (start, end) in enumerate(spans)
        ]
        try:
            for future in futures:
                future.result()
                digest.catch_up()  # what landed ahead of this range, now that the hash has reached it
        except BaseException:
            _stop(futures)
            raise
        if digest.hashed != size or digest.hexdigest() != entry["sha256"]:
            raise UnverifiedCheckpoint(_mismatch(where, digest.hexdigest(), digest.hashed, entry))
        os.replace(tmp, dest)
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)


class _RangePool:
    """Threads that run the ranged GETs of every file being fetched, the lowest rank (a range's place in its file)
    first, then in the order submitted: each file's next range before any file's later ones, so that few ranges
    run ahead of their file's hash. A ``ThreadPoolExecutor`` takes them in the order submitted, which puts the
    first file's every range in flight before the second file's first."""

    def __init__(self, threads: int) -> None:
        self._max, self._idle = max(1, threads), 0
        self._threads: list[threading.Thread] = []
        self._queue: list[tuple[int, int, Future, Any, tuple]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def submit(self, rank: int, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            heapq.heappush(self._queue, (rank, next(self._order), future, fn, args))
            self._cond.notify()
            if len(self._queue) > self._idle and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"fetch-range-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._queue:
                    return
                _, _, future, fn, args = heapq.heappop(self._queue)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(exc)

    def __enter__(self) -> _RangePool:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()


class _InOrderDigest:
    """The sha256 of a file whose ranges are written concurrently, in whatever order they land.

    A range's bytes that continue what is hashed are hashed by its own thread as they arrive, from memory; bytes
    written ahead are remembered and hashed from the file by ``catch_up`` (the file's thread, between waits) once
    the hash reaches them, so that no range's reading waits on another's hashing. Each byte is hashed once, in
    file order."""

    def __init__(self, fd: int) -> None:
        self.fd, self.hashed = fd, 0  # the bytes [0, hashed) are hashed
        self._digest = hashlib.sha256()
        self._busy = False  # a thread is hashing from ``hashed`` on
        self._ahead: dict[int, int] = {}  # start -> end of the stretches written past ``hashed``, not hashed yet
        self._ends: dict[int, int] = {}  # end -> start of the same stretches
        self._lock = threading.Lock()

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` (every byte of the file once), hashing it now if it continues the hash."""
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        end = offset + len(view)
        with self._lock:
            if offset != self.hashed or self._busy:
                start = self._ends.pop(offset, offset)
                self._ahead[start], self._ends[end] = end, start
                return
            self._busy = True
        self._hash(view, end)

    def catch_up(self) -> None:
        """Hash, from the file, the stretches written ahead that now continue the hash."""
        buffer = None
        while True:
            with self._lock:
                if self._busy or self.hashed not in self._ahead:
                    return
                start = self.hashed
                stop = self._ahead.pop(start)
                del self._ends[stop]
                self._busy = True
            buffer = buffer or bytearray(_HASH_PIECE)
            for at in range(start, stop, _HASH_PIECE):
                read = os.preadv(self.fd, [memoryview(buffer)[: min(_HASH_PIECE, stop - at)]], at)
                self._digest.update(memoryview(buffer)[:read])
                if read < min(_HASH_PIECE, stop - at):  # cannot happen unless the file is changed meanwhile
                    stop = at + read
                    break
            self._hash(b"", stop)

    def _hash(self, data: bytes | memoryview, end: int) -> None:
        self._digest.update(data)
        with self._lock:
            self.hashed, self._busy = end, False

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _fetch_range(
    client: Any, bucket: str, key: str, out: _InOrderDigest, start: int, end: int, entry: dict[str, Any]
) -> None:
    """Write bytes [start, end) of the object at their place in ``out``, checking the size the store reports; a
    stream that breaks is asked again from where it broke."""
    where = f"s3://{bucket}/{key}"
    retryable = _stream_errors()
    offset = start
    for attempt in range(1, _RANGE_ATTEMPTS + 1):
        try:
            request = {"Bucket": bucket, "Key": key}
            if end > offset:  # an empty object has no range to ask for
                request["Range"] = f"bytes={offset}-{end - 1}"
            response = client.get_object(**request)
            total = _object_size(response)
            if total != entry["size"]:
                raise UnverifiedCheckpoint(_mismatch(where, "(not read)", total, entry))
            for piece in response["Body"].iter_chunks(_READ):
                if offset + len(piece) > end:
                    raise UnverifiedCheckpoint(f"{where}: the store sent more than bytes {start}-{end} asked for")
                out.write(offset, piece)
                offset += len(piece)
            if offset == end:
                return
            if attempt == _RANGE_ATTEMPTS:
                raise UnverifiedCheckpoint(f"{where}: the store sent bytes {start}-{offset} of {start}-{end}")
        except retryable:
            if attempt == _RANGE_ATTEMPTS:
                raise
        except Exception as exc:
            code = _error_code(exc)
            if code in ("NoSuchKey", "404"):
                raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
            if code == "InvalidRange":  # the object is shorter than the range
                raise UnverifiedCheckpoint(_mismatch(where, "(not read)", "fewer", entry)) from None
            raise


def _object_size(response: dict[str, Any]) -> int | None:
    content_range = response.get("ContentRange")  # "bytes 0-99/1234"
    if content_range:
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    return response.get("ContentLength")


def _stream_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import ConnectionClosedError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError

    return (
        socket.timeout,
        ConnectionError,
        ReadTimeoutError,
        IncompleteReadError,
        ResponseStreamingError,
        ConnectionClosedError,
    )


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


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


def s3_client() -> Any:
    """A boto3 S3 client from the environment: the usual credential variables, ``AWS_ENDPOINT_URL`` (an
    S3-compatible server) and ``AWS_CA_BUNDLE`` (its CA over https)."""
    import boto3  # only s3:// URIs need it

    # boto3 reads both variables itself in recent releases; passing them keeps older ones on the same endpoint.
    return boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        verify=os.environ.get("AWS_CA_BUNDLE") or None,
    )


def _copy_checked(source: BinaryIO, entry: dict[str, Any], target: Path, where: str) -> None:
    """Copy ``source`` to ``target/<path>`` through a temporary name, renamed only when size and sha256 match."""
    dest = target / entry["path"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
            raise UnverifiedCheckpoint(_mismatch(where, digest.hexdigest(), size, entry))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _finish(raw: bytes, files: list[dict[str, Any]], target: Path) -> VerifiedCheckpoint:
    target.mkdir(parents=True, exist_ok=True)
    (target / contract.MANIFEST_FILENAME).write_bytes(raw)
    return VerifiedCheckpoint(target, hashlib.sha256(raw).hexdigest(), len(files), sum(e["size"] for e in files))


def _mismatch(where: str, sha256: str, size: object, entry: dict[str, Any]) -> str:
    return (
        f"{where}: sha256 {sha256} ({size} bytes) but {contract.MANIFEST_FILENAME} says {entry['sha256']} "
        f"({entry['size']} bytes): the checkpoint is corrupt or incomplete; refusing to serve it"
    )


def _no_manifest(where: object) -> str:
    return (
        f"{where} has no {contract.MANIFEST_FILENAME}: refusing to serve a checkpoint that cannot be verified "
        "(store it with a gpuferry checkpoint store, which writes the manifest last)"
    )
