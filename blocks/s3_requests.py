"""The request-level parts of ``S3CheckpointStore`` (``blocks/s3.py``): what S3's errors mean for the user, the
record of unfinished multipart uploads, and the pools requests run in."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from blocks.errors import ConfigurationError, TransientError
from blocks.home import gpuferry_home


# Error codes no retry mends → the field to fix. A HEAD answer has no body: its code is the HTTP status.
_CONFIG_ERRORS = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix bucket.bucket_name",
    "InvalidBucketName": "the store refuses this bucket name: fix bucket.bucket_name (S3 allows 3-63 lowercase "
    "letters, digits, '-' and '.')",
    "AccessDenied": "access denied: check bucket.credentials (aws_access_key_id, aws_secret_access_key) and the "
    "bucket's policy",
    "403": "the store refused the request (403): check bucket.credentials (aws_access_key_id, "
    "aws_secret_access_key) and the bucket's policy",
    "InvalidAccessKeyId": "the store knows no such access key: fix bucket.credentials.aws_access_key_id",
    "SignatureDoesNotMatch": "the request's signature does not match: fix bucket.credentials.aws_secret_access_key "
    "(it must be the secret of bucket.credentials.aws_access_key_id)",
    "AuthorizationHeaderMalformed": "the request names another region than the store's: fix "
    "bucket.credentials.region_name",
    "AllAccessDisabled": "all access to the bucket is disabled: fix bucket.bucket_name",
}
_CA_FIELD = "bucket.credentials.aws_client_parameters.verify_cert_path"
_ENDPOINT_FIELD = "bucket.credentials.aws_client_parameters.endpoint_url"


def error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def tls_refusal(exc: BaseException | None) -> str | None:
    """The reason a TLS handshake failed that no retry mends (an untrusted certificate, an endpoint that speaks no
    TLS), or None; a connection that broke during the handshake is not one of these."""
    if exc is None or type(exc).__name__ != "SSLError":  # botocore's SSLError
        return None
    text = str(exc)
    return next((reason for reason in ("CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER") if reason in text), None)


def no_retry_of_tls_refusals(caught_exception: BaseException | None = None, **_: Any) -> bool | None:
    """A botocore ``needs-retry`` handler: False (do not retry) for a TLS refusal, None (let the others decide)
    otherwise. botocore retries every connection error, an untrusted certificate 4 times over ~10 s."""
    return False if tls_refusal(caught_exception) else None


class explained:
    """Errors of the store that no retry mends (no bucket, bad credentials, an untrusted TLS certificate) become
    ConfigurationError, naming the field to fix; everything else propagates as the client raised it."""

    def __init__(self, bucket: str, key: str) -> None:
        self.where = f"s3://{bucket}/{key}"

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        if exc is None:
            return
        code = error_code(exc)
        if code in _CONFIG_ERRORS:
            raise ConfigurationError(f"{self.where}: {code}: {_CONFIG_ERRORS[code]}") from exc
        refusal = tls_refusal(exc)
        if refusal:
            text = str(exc)
            if refusal == "CERTIFICATE_VERIFY_FAILED":
                raise ConfigurationError(
                    f"{self.where}: the store's TLS certificate is not trusted ({text}): set {_CA_FIELD} to the "
                    f"certificate (PEM) of the CA that signed it, or fix the host in {_ENDPOINT_FIELD}"
                ) from exc
            else:
                raise ConfigurationError(
                    f"{self.where}: the endpoint does not speak TLS ({text}): fix {_ENDPOINT_FIELD} "
                    "(http://, or the store's https port)"
                ) from exc
        if type(exc).__name__ == "RetriesExceededError":  # s3transfer gave up; it keeps no __cause__
            last = getattr(exc, "last_exception", None)
            raise TransientError(f"{self.where}: the transfer failed after retries: {last!r}") from last


# ---- multipart bookkeeping ---------------------------------------------------------------------


def md5_hex(body: bytes) -> str:
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
