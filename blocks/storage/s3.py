"""Checkpoints in S3 or any S3-compatible store (MinIO, Ceph RGW): verified, stored once, fast.

The layout is the one of ``LocalCheckpointStore``: ``s3://<bucket>/<bucket_folder>/<prefix>/<name>/``
holds the checkpoint's files and ``MANIFEST.json`` (path, size, sha256 of each file), written last;
readers trust only a checkpoint that has one.

Upload: ``runtime.s3_upload.put_directory``, which a cluster that wrote the checkpoint runs too (``python -m
runtime.store``): each file is hashed (through the local hash cache, so an unchanged file is not read again),
then sent only if the stored object does not already carry the same sha256 (object metadata ``sha256``) and
size, so storing an unchanged checkpoint moves 0 bytes and an interrupted upload resumes without resending the
files it finished. Large files go multipart, parts of several files in flight at once, and an interrupted
multipart upload is resumed inside the file (see that module).

Every request body is signed with its sha256 (SigV4 payload signing, over https too: AWS S3, MinIO and
Ceph RGW check it and refuse a body damaged on the way). botocore's own CRC32 is not sent: over https
it travels as an aws-chunked trailer, which Ceph RGW 16 refuses (``MissingContentLength``), and RGW 16
ignores it anyway. The answer of
CompleteMultipartUpload is not relied on (RGW 16 answers an empty ETag): every object is read back
(HEAD: size and sha256) after its upload.

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

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect_aws import MinIOCredentials, S3Bucket
from pydantic import Field, SecretStr, field_validator

from blocks.base.storage import (
    MANIFEST,
    CheckpointStore,
    HashCache,
    RemoteDestination,
    checkpoint_files,
    checkpoint_ref,
    parse_manifest,
)
from blocks.checks import CheckRow, Probe
from blocks.errors import ChecksumMismatch, ConfigurationError
from blocks.records import CheckpointRef, Garbage
from blocks.storage.s3_requests import UploadJournal, explained
from runtime import checkpoint as verified
from runtime import s3_upload
from runtime.contract import ManifestError
from runtime.s3_errors import no_retry_of_tls_refusals
from runtime.s3_upload import read_object as _read_object

_MiB = 1 << 20
SHA256_METADATA = s3_upload.SHA256_METADATA  # stored as the object's x-amz-meta-sha256 header
# Characters no S3-compatible store takes in a bucket name; the stricter rules are each store's own.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_CLIENT_LOCK = threading.Lock()


def s3_client(credentials: Any, config: Any = None) -> Any:
    """The one way an S3 client of the store is made: prefect-aws's ``AwsCredentials`` or ``MinIOCredentials`` with
    their client parameters (endpoint, TLS), the settings every request to an S3-compatible store needs, and
    ``config`` (a botocore ``Config``: pool size, timeouts, retries) over them. The pipeline's store and
    ``gpuferry check`` thus talk to the store the same way."""
    from botocore.config import Config

    params = credentials.aws_client_parameters.get_params_override()
    base = params.pop("config", None) or Config()
    params["config"] = base.merge(
        Config(
            # No CRC32 of botocore's: over https it goes in an aws-chunked trailer, which Ceph RGW 16 refuses
            # (MissingContentLength), and RGW ignores it anyway.
            request_checksum_calculation="when_required",
            # Instead every body is signed with its sha256, over https too: the check that AWS S3, MinIO and
            # Ceph RGW all make before they keep a body.
            s3={**(base.s3 or {}), "payload_signing_enabled": True},
        )
    ).merge(config or Config())
    if getattr(credentials, "region_name", None):
        params["region_name"] = credentials.region_name
    client = credentials.get_boto3_session().client("s3", **params)
    client.meta.events.register_first("needs-retry.s3", no_retry_of_tls_refusals)
    return client


@lru_cache(maxsize=8)
def _pooled_client(credentials: Any, max_pool_connections: int) -> Any:
    """One client per credentials and pool size (clients are thread-safe; creating one is not): one pooled
    connection per transfer thread, or threads queue for connections."""
    from botocore.config import Config

    with _CLIENT_LOCK:
        return s3_client(credentials, Config(max_pool_connections=max_pool_connections))


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key/prefix`` → (bucket, key prefix without a trailing slash)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigurationError(f"{uri!r} is not an S3 checkpoint URI (s3://<bucket>/<key>)")
    return parsed.netloc, parsed.path.strip("/")


def _keys(credentials: Any) -> tuple[str | None, str | None, str | None]:
    """(key id, secret key, session token) of prefect-aws's ``AwsCredentials`` or ``MinIOCredentials`` (whose root
    user and password are the keys)."""

    def plain(value: Any) -> str | None:
        return value.get_secret_value() if isinstance(value, SecretStr) else value

    if isinstance(credentials, MinIOCredentials):
        return credentials.minio_root_user, plain(credentials.minio_root_password), None
    return (
        credentials.aws_access_key_id,
        plain(credentials.aws_secret_access_key),
        plain(credentials.aws_session_token),
    )


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
        4,
        ge=1,
        le=64,
        description="Files hashed, checked and uploaded at the same time (downloads fetch as many "
        "files at once as max_concurrency keeps busy).",
    )
    download_chunksize_mib: int = Field(
        64,
        ge=1,
        le=5 * 1024,
        description="Size of one ranged GET (MiB) when downloading; larger files are fetched in ranges.",
    )

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
        return _pooled_client(self.bucket.credentials, self.max_concurrency + self.max_parallel_files + 2)

    def _checkpoint_key(self, name: str) -> str:
        parts = [self.bucket.bucket_folder.strip("/"), self.prefix.strip("/"), self.check_checkpoint_name(name)]
        return "/".join(p for p in parts if p)

    def uri_of(self, name: str) -> str:
        return f"s3://{self.bucket.bucket_name}/{self._checkpoint_key(name)}"

    # ---- the store ----

    def upload_settings(self) -> s3_upload.UploadSettings:
        return s3_upload.UploadSettings(
            multipart_threshold=self.multipart_threshold_mib * _MiB,
            part_size=self.multipart_chunksize_mib * _MiB,
            max_concurrency=self.max_concurrency,
            max_parallel_files=self.max_parallel_files,
        )

    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        source = Path(local_dir)
        bucket, root = self.bucket.bucket_name, self._checkpoint_key(name)
        checkpoint_files(source)  # an empty directory is a ConfigurationError
        client = self.client()
        try:
            raw, manifest, moved = s3_upload.put_directory(
                client,
                bucket,
                root,
                source,
                self.upload_settings(),
                cache=HashCache(),
                journal=UploadJournal(client.meta.endpoint_url, bucket),
                explained=explained,
            )
        except s3_upload.StoredMismatch as exc:
            raise ChecksumMismatch(str(exc)) from None
        return checkpoint_ref(f"s3://{bucket}/{root}", raw, manifest, moved)

    def reader_env(self) -> dict[str, SecretStr]:
        """boto3's variables for the model server: the endpoint, region, keys and the CA certificate's path."""
        creds = self.bucket.credentials
        params = creds.aws_client_parameters
        key_id, secret, token = _keys(creds)
        values = {
            "AWS_ENDPOINT_URL": params.endpoint_url,
            "AWS_DEFAULT_REGION": creds.region_name,
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_CA_BUNDLE": params.verify_cert_path,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_SESSION_TOKEN": token,
        }
        return {key: SecretStr(str(value)) for key, value in values.items() if value}

    def remote_destination(self, name: str) -> RemoteDestination:
        """Checkpoint ``name`` as ``python -m runtime.store`` on a cluster stores it: boto3's variables for the
        endpoint, region and keys (the keys as secrets), the CA certificate's contents, the transfer settings."""
        creds = self.bucket.credentials
        params = creds.aws_client_parameters
        if params.verify is False:
            raise ConfigurationError(
                "bucket.credentials.aws_client_parameters.verify=False cannot be carried to a cluster: give the "
                "CA certificate in verify_cert_path instead"
            )
        env = {
            key: value
            for key, value in (("AWS_ENDPOINT_URL", params.endpoint_url), ("AWS_DEFAULT_REGION", creds.region_name))
            if value
        }
        key_id, secret, token = _keys(creds)
        secrets = {"AWS_ACCESS_KEY_ID": key_id or ""}
        for key, value in (("AWS_SECRET_ACCESS_KEY", secret), ("AWS_SESSION_TOKEN", token)):
            if value is not None:
                secrets[key] = value
        if not secrets["AWS_ACCESS_KEY_ID"] or "AWS_SECRET_ACCESS_KEY" not in secrets:
            raise ConfigurationError(
                "bucket.credentials has no aws_access_key_id / aws_secret_access_key: a cluster storing a checkpoint "
                "needs keys of its own to give it (an instance profile or a named profile is this machine's)"
            )
        ca = None
        if params.verify_cert_path:
            try:
                ca = Path(params.verify_cert_path).read_bytes()
            except OSError as exc:
                raise ConfigurationError(f"bucket.credentials.aws_client_parameters.verify_cert_path: {exc}") from None
        settings = self.upload_settings()
        args = [
            f"--multipart-threshold={settings.multipart_threshold}",
            f"--part-size={settings.part_size}",
            f"--max-concurrency={settings.max_concurrency}",
            f"--max-parallel-files={settings.max_parallel_files}",
        ]
        return RemoteDestination(uri=self.uri_of(name), env=env, secrets=secrets, ca_bundle=ca, args=args)

    def get(self, uri: str, dest: str | Path) -> Path:
        bucket, root = parse_s3_uri(uri)
        with explained(bucket, root), _refusals(uri):
            verified.fetch_s3(
                self.client(),
                bucket,
                root,
                dest,
                chunk_size=self.download_chunksize_mib * _MiB,
                max_concurrency=self.max_concurrency,
            )
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

    def stored(self) -> list[Garbage]:
        """One listing of the prefix: each checkpoint is the folder of a manifest; its size, every object in it."""
        root = "/".join(p for p in (self.bucket.bucket_folder.strip("/"), self.prefix.strip("/")) if p)
        bucket = self.bucket.bucket_name
        objects: list[tuple[str, int]] = []
        manifests: dict[str, float] = {}
        with explained(bucket, root):
            pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/")
            for page in pages:
                for item in page.get("Contents", []):
                    objects.append((item["Key"], int(item["Size"])))
                    if item["Key"].endswith(f"/{MANIFEST}"):
                        manifests[item["Key"].removesuffix(f"/{MANIFEST}")] = item["LastModified"].timestamp()
        sizes = dict.fromkeys(manifests, 0)
        for key, size in objects:
            folder = key.rsplit("/", 1)[0]
            while folder and folder not in sizes:
                folder = folder.rsplit("/", 1)[0] if "/" in folder else ""
            if folder:
                sizes[folder] += size
        return [
            Garbage(kind="checkpoint", where=f"s3://{bucket}/{key}", size_bytes=sizes[key], modified=modified)
            for key, modified in sorted(manifests.items())
        ]

    def remove(self, uri: str) -> None:
        root = "/".join(p for p in (self.bucket.bucket_folder.strip("/"), self.prefix.strip("/")) if p)
        if not uri.startswith(f"s3://{self.bucket.bucket_name}/{root}/"):
            raise ConfigurationError(f"{uri} is not a checkpoint of this store (s3://{self.bucket.bucket_name}/{root})")
        self.delete(uri)

    def delete(self, uri: str) -> int:  # type: ignore[override]  # Block.delete removes a saved block document
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

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The endpoint, the bucket, and a probe object put, read back and deleted (``blocks/checks.py``)."""
        from blocks.storage.check import check_s3

        check_s3(self, probe)
        return probe.rows


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
