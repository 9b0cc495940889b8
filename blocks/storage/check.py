"""The checks of an S3 bucket (``S3CheckpointStore.self_check``): the endpoint answers, the credentials are
accepted, the bucket exists and a probe object can be written, read back and deleted.

Clients are made here with the probe's deadline as their timeout and no retries of their own: a check says at
once what does not answer instead of retrying it for minutes as a pipeline step would.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from blocks.checks import PROBE_PREFIX, CheckFailed, Probe, reach_url

if TYPE_CHECKING:
    from blocks.storage.s3 import S3CheckpointStore


def _s3_client(store: S3CheckpointStore, timeout: float) -> Any:
    """The store's client (``s3_client``) with the probe's deadline as its timeouts and no retries."""
    from botocore.config import Config

    from blocks.storage.s3 import s3_client

    return s3_client(
        store.bucket.credentials,
        Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1, "mode": "standard"}),
    )


def _s3_code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""


def check_s3(store: S3CheckpointStore, probe: Probe) -> None:
    """The endpoint answers, the bucket exists and takes the credentials, and a probe object can be put, read
    back and deleted under the store's prefix."""
    bucket = store.bucket.bucket_name
    endpoint = store.bucket.credentials.aws_client_parameters.endpoint_url
    if endpoint and not reach_url(
        probe, str(endpoint), "start the S3 server, or fix bucket.credentials.aws_client_parameters.endpoint_url"
    ):
        return
    client = _s3_client(store, probe.left)

    def exists() -> str:
        try:
            client.head_bucket(Bucket=bucket)
        except Exception as exc:  # botocore's errors, named by their code
            code = _s3_code(exc)
            if code in ("404", "NoSuchBucket"):
                raise CheckFailed(
                    f"bucket {bucket!r} does not exist",
                    f"create it (`aws s3 mb s3://{bucket}`), or fix bucket.bucket_name",
                ) from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise CheckFailed(
                    f"bucket {bucket!r}: access denied ({code})",
                    "fix bucket.credentials, or grant them s3:ListBucket on the bucket",
                ) from None
            raise
        return f"s3://{bucket} ({client.meta.endpoint_url})"

    if not probe.step("bucket", exists, "check the endpoint and bucket.credentials"):
        return
    folder = "/".join(p.strip("/") for p in (store.bucket.bucket_folder, store.prefix) if p.strip("/"))
    key = "/".join(p for p in (folder, f"{PROBE_PREFIX}{probe.probe_id}") if p)
    body = secrets.token_bytes(32)

    def put_get_delete() -> str:
        started = time.monotonic()
        client.put_object(Bucket=bucket, Key=key, Body=body)
        try:
            read = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            if read != body:
                raise CheckFailed(
                    f"s3://{bucket}/{key} read back {len(read)} bytes that differ from the 32 put",
                    "the store corrupts objects: check its configuration",
                )
        finally:
            client.delete_object(Bucket=bucket, Key=key)
        return f"put, get and delete of s3://{bucket}/{key} ({(time.monotonic() - started) * 1000:.0f} ms)"

    probe.step(
        "put, get, delete",
        put_get_delete,
        "grant the credentials s3:PutObject, s3:GetObject and s3:DeleteObject under the store's prefix",
    )
