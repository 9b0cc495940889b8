"""Checkpoints in S3 or any S3-compatible store (MinIO, Ceph RGW): verified, stored once, fast.

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
Other unfinished uploads under the checkpoint are aborted once it is complete.

Every request body is signed with its sha256 (SigV4 payload signing, over https too: AWS S3, MinIO and
Ceph RGW check it and refuse a body damaged on the way). botocore's own CRC32 is not sent: over https
it travels as an aws-chunked trailer, which Ceph RGW 16 refuses (``MissingContentLength``), and RGW 16
ignores it anyway. The answer of
CompleteMultipartUpload is not relied on (RGW 16 answers an empty ETag): every object is read back
(HEAD: size and sha256) after its upload. A changed checkpoint's old manifest is deleted before its
first changed file is sent: readers never see a manifest that does not match the files.

Download: ``runtime.checkpoint.fetch_s3``, the inference server's own fetch (the same reads, the same
checks): every file is written to a temporary name, hashed, and renamed only when its size and sha256
match the manifest; a mismatch raises ``ChecksumMismatch`` naming the object.

Point ``bucket.credentials.aws_client_parameters.endpoint_url`` at MinIO/Ceph for a non-AWS store, and
``verify_cert_path`` beside it at the CA certificate of a store whose TLS certificate a private CA
signed. Errors that no retry mends (credentials, bucket name, an untrusted certificate) become
``ConfigurationError`` naming the field to fix; the rest are the S3 client's own, and
``tasks/retry.py`` decides which are transient.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect_aws import S3Bucket
from pydantic import Field, field_validator

from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.s3_requests import (
    Once,
    RequestPool,
    UploadJournal,
    abort_leftover_uploads,
    error_code,
    explained,
    listed_parts,
    md5_hex,
    no_retry_of_tls_refusals,
    parallel,
    results,
    upload_is_gone,
)
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
)
from runtime import checkpoint as verified
from runtime.contract import ManifestError

_MiB = 1 << 20
_MAX_PARTS = 10_000  # S3's limit on the parts of one upload
SHA256_METADATA = "sha256"  # stored as the object's x-amz-meta-sha256 header
# Characters no S3-compatible store takes in a bucket name; the stricter rules are each store's own.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_CLIENT_LOCK = threading.Lock()


@lru_cache(maxsize=8)
def _s3_client(credentials: Any, max_pool_connections: int) -> Any:
    """One client per credentials and pool size (clients are thread-safe; creating one is not)."""
    from botocore.config import Config

    with _CLIENT_LOCK:
        params = credentials.aws_client_parameters.get_params_override()
        config = params.pop("config", None) or Config()
        params["config"] = config.merge(Config(
            # One pooled connection per transfer thread, or threads queue for connections.
            max_pool_connections=max_pool_connections,
            # No CRC32 of botocore's: over https it goes in an aws-chunked trailer, which Ceph RGW 16 refuses
            # (MissingContentLength), and RGW ignores it anyway.
            request_checksum_calculation="when_required",
            # Instead every body is signed with its sha256, over https too: the check that AWS S3, MinIO and
            # Ceph RGW all make before they keep a body.
            s3={**(config.s3 or {}), "payload_signing_enabled": True},
        ))  # fmt: skip
        if getattr(credentials, "region_name", None):
            params["region_name"] = credentials.region_name
        client = credentials.get_boto3_session().client("s3", **params)
        client.meta.events.register_first("needs-retry.s3", no_retry_of_tls_refusals)
        return client


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
        "endpoint URL for MinIO, Ceph or another S3-compatible store, and the CA certificate (verify_cert_path) "
        "of a store whose TLS certificate a private CA signed.",
    )
    multipart_threshold_mib: int = Field(
        64, ge=5, le=5 * 1024, description="Files at least this large (MiB) are uploaded in parts."
    )
    multipart_chunksize_mib: int = Field(
        16, ge=5, le=5 * 1024, description="Size of one part (MiB) of a multipart upload."
    )
    max_concurrency: int = Field(
        10, ge=1, le=128, description="Requests (parts and ranged GETs, of all files together) in flight at once."
    )
    max_parallel_files: int = Field(
        4, ge=1, le=64, description="Files hashed, checked and uploaded at the same time (downloads fetch as many "
        "files at once as max_concurrency keeps busy)."
    )
    download_chunksize_mib: int = Field(
        64, ge=1, le=5 * 1024,
        description="Size of one ranged GET (MiB) when downloading; larger files are fetched in ranges.",
    )  # fmt: skip
    @field_validator("bucket")
    @classmethod
    def _bucket_name_is_a_name(cls, bucket: S3Bucket) -> S3Bucket:
        name = bucket.bucket_name
        if not _BUCKET_NAME.fullmatch(name):
            hint = " (give the name alone, without s3:// or a path)" if "/" in name else ""
            raise ValueError(
                f"bucket.bucket_name {name!r} is not a bucket name{hint}: S3 bucket names are 3-63 lowercase "
                "letters, digits, '-' and '.'"
            )
        return bucket

    # ---- clients and keys ----

    def client(self) -> Any:
        return _s3_client(self.bucket.credentials, self.max_concurrency + self.max_parallel_files + 2)

    def _checkpoint_key(self, name: str) -> str:
        parts = [self.bucket.bucket_folder.strip("/"), self.prefix.strip("/"), self.check_checkpoint_name(name)]
        return "/".join(p for p in parts if p)

    def uri_of(self, name: str) -> str:
        return f"s3://{self.bucket.bucket_name}/{self._checkpoint_key(name)}"

    # ---- the store ----

    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        source = Path(local_dir)
        bucket, root = self.bucket.bucket_name, self._checkpoint_key(name)
        files = checkpoint_files(source)
        client = self.client()
        cache, journal = HashCache(), UploadJournal(client.meta.endpoint_url, bucket)
        manifest_key = f"{root}/{MANIFEST}"
        with explained(bucket, manifest_key):
            old_manifest = _read_object(client, bucket, manifest_key)
        invalidate = Once(lambda: client.delete_object(Bucket=bucket, Key=manifest_key) if old_manifest else None)

        requests = RequestPool(self.max_concurrency)
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
                if entry["size"] >= self.multipart_threshold_mib * _MiB:
                    sent = self._put_multipart(client, requests, journal, path, key, entry)
                else:
                    sent = requests.submit(self._put_small, client, key, path, entry).result()
                stored = _head(client, bucket, key)
            if not _matches(stored, entry["size"], entry["sha256"]):
                raise ChecksumMismatch(
                    f"s3://{bucket}/{key}: after the upload the store reports {_describe(stored)}, "
                    f"expected {entry['size']} bytes with sha256 {entry['sha256']}"
                )
            return entry, sent

        try:
            stored_files = parallel(store_one, files, self.max_parallel_files)
        finally:
            requests.shutdown(wait=True, cancel_futures=True)

        manifest = manifest_from_entries([entry for entry, _ in stored_files])
        raw = manifest_bytes(manifest)
        if raw != old_manifest:
            with explained(bucket, manifest_key):
                digest = hashlib.sha256(raw).hexdigest()
                client.put_object(
                    Bucket=bucket, Key=manifest_key, Body=raw, ContentType="application/json",
                    Metadata={SHA256_METADATA: digest},
                )  # fmt: skip
                if not _matches(_head(client, bucket, manifest_key), len(raw), digest):
                    raise ChecksumMismatch(f"s3://{bucket}/{manifest_key}: the stored manifest does not match")
        with explained(bucket, root):
            abort_leftover_uploads(client, bucket, root)
        return checkpoint_ref(f"s3://{bucket}/{root}", raw, manifest, sum(moved for _, moved in stored_files))

    def _put_small(self, client: Any, key: str, path: Path, entry: dict) -> int:
        with open(path, "rb") as body:
            client.put_object(
                Bucket=self.bucket.bucket_name, Key=key, Body=body, Metadata={SHA256_METADATA: entry["sha256"]}
            )
        return entry["size"]

    def _put_multipart(
        self, client: Any, requests: RequestPool, journal: UploadJournal, path: Path, key: str, entry: dict
    ) -> int:
        """Upload ``path`` in parts, resuming this content's unfinished upload if there is one; returns bytes sent."""
        bucket, size = self.bucket.bucket_name, entry["size"]
        part_size = max(self.multipart_chunksize_mib * _MiB, -(-size // _MAX_PARTS))
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
            upload_id = client.create_multipart_upload(
                Bucket=bucket, Key=key, Metadata={SHA256_METADATA: entry["sha256"]}
            )["UploadId"]
            journal.record(key, upload_id, entry["sha256"], part_size)

        with open(path, "rb") as f:

            def send(number: int) -> tuple[dict, int]:
                offset = (number - 1) * part_size
                body = os.pread(f.fileno(), min(part_size, size - offset), offset)
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

    def get(self, uri: str, dest: str | Path) -> Path:
        bucket, root = parse_s3_uri(uri)
        with explained(bucket, root), _refusals(uri):
            verified.fetch_s3(
                self.client(), bucket, root, dest, chunk_size=self.download_chunksize_mib * _MiB,
                max_concurrency=self.max_concurrency,
            )  # fmt: skip
        return Path(dest)

    def read_manifest(self, uri: str) -> dict:
        """The checkpoint's manifest; ``ChecksumMismatch`` when it has none (its upload did not finish)."""
        bucket, root = parse_s3_uri(uri)
        with explained(bucket, f"{root}/{MANIFEST}"), _refusals(uri):
            raw = verified.read_s3_manifest(self.client(), bucket, root)
        return parse_manifest(raw, uri)

    def _read_bytes(self, uri: str, path: str) -> bytes | None:
        bucket, root = parse_s3_uri(uri)
        key = f"{root}/{path}"
        with explained(bucket, key):
            return _read_object(self.client(), bucket, key)

    def delete(self, uri: str) -> int:
        """Delete a stored checkpoint (its manifest first, so readers stop trusting it); returns objects deleted."""
        bucket, root = parse_s3_uri(uri)
        client = self.client()
        deleted = 0
        with explained(bucket, root):
            client.delete_object(Bucket=bucket, Key=f"{root}/{MANIFEST}")
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/"):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                    deleted += len(keys)
        return deleted


# ---- helpers ----------------------------------------------------------------------------------


@contextmanager
def _refusals(uri: str) -> Iterator[None]:
    """What the verified fetch refuses, as the stores say it: ``ChecksumMismatch``."""
    try:
        yield
    except verified.NoManifest:
        raise ChecksumMismatch(
            f"{uri} has no {MANIFEST}: the checkpoint is incomplete (its upload did not finish)"
        ) from None
    except (verified.UnverifiedCheckpoint, ManifestError) as exc:
        raise ChecksumMismatch(str(exc)) from None


def _read_object(client: Any, bucket: str, key: str) -> bytes | None:
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
