"""Checkpoints in S3 or any S3-compatible store (MinIO, Ceph, moto): verified, stored once, fast.

The layout is the one of ``LocalCheckpointStore``: ``s3://<bucket>/<bucket_folder>/<prefix>/<name>/``
holds the checkpoint's files and ``MANIFEST.json`` (path, size, sha256 of each file), written last;
readers trust only a checkpoint that has one.

Upload: each file is hashed, then sent only if the stored object does not already carry the same
sha256 (object metadata ``sha256``) and size, so storing an unchanged checkpoint moves 0 bytes and an
interrupted upload resumes without resending the files it finished (the parts an interrupted
multipart upload left behind are aborted once the checkpoint is complete). Large files go multipart;
the files share one transfer manager, so parts of several files are in flight at once. Each request
carries botocore's body checksum (CRC32; S3 and MinIO reject a body that does not match it, moto does
not check) and every object is read back (HEAD: size and sha256) after its upload. A changed
checkpoint's old manifest is deleted before its first changed file is sent: readers never see a
manifest that does not match the files.

Download: every file is written to a temporary name, hashed, and renamed only when its sha256
matches the manifest; a mismatch raises ``ChecksumMismatch`` naming the object.

Point ``bucket.credentials.aws_client_parameters.endpoint_url`` at MinIO/Ceph for a
non-AWS store. Errors are the S3 client's own; ``tasks/retry.py`` decides which are transient.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect_aws import S3Bucket
from pydantic import Field

from blocks.errors import ChecksumMismatch, ConfigurationError, TransientError
from blocks.specs import CheckpointRef
from blocks.storage import (
    MANIFEST,
    CheckpointStore,
    checkpoint_files,
    checkpoint_ref,
    manifest_bytes,
    manifest_entry,
    manifest_from_entries,
    parse_manifest,
    sha256_file,
)

_MiB = 1 << 20
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

    def _upload_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold_mib * _MiB,
            multipart_chunksize=self.multipart_chunksize_mib * _MiB,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

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
        manifest_key = f"{root}/{MANIFEST}"
        with _explained(bucket, manifest_key):
            old_manifest = _read_object(client, bucket, manifest_key)
        invalidate = _Once(lambda: client.delete_object(Bucket=bucket, Key=manifest_key) if old_manifest else None)

        from boto3.s3.transfer import create_transfer_manager

        with create_transfer_manager(client, self._upload_config()) as transfers:

            def store_one(path: Path) -> tuple[dict, int]:
                entry = manifest_entry(source, path)
                key = f"{root}/{entry['path']}"
                with _explained(bucket, key):
                    if _matches(_head(client, bucket, key), entry["size"], entry["sha256"]):
                        return entry, 0
                    invalidate()  # the stored checkpoint is about to change: readers must not trust it
                    transfers.upload(
                        str(path), bucket, key, extra_args={"Metadata": {SHA256_METADATA: entry["sha256"]}}
                    ).result()
                    stored = _head(client, bucket, key)
                if not _matches(stored, entry["size"], entry["sha256"]):
                    raise ChecksumMismatch(
                        f"s3://{bucket}/{key}: after the upload the store reports {_describe(stored)}, "
                        f"expected {entry['size']} bytes with sha256 {entry['sha256']}"
                    )
                return entry, entry["size"]

            results = _parallel(store_one, files, self.max_parallel_files)

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


def _parallel(fn: Callable[[Any], Any], items: list, workers: int) -> list:
    """``fn`` over ``items`` in threads, results in order; the first error is raised after all stop."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="gpuferry-s3") as pool:
        futures = [pool.submit(fn, item) for item in items]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]
