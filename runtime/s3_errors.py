"""What an S3 store's errors mean for the user: the field to fix, or a passing failure.

Shared by gpuferry's S3 checkpoint store (``blocks/storage/s3.py``, which raises ConfigurationError /
TransientError) and ``python -m runtime.store`` on a cluster (which reports the kind and the message back). botocore
only.
"""

from __future__ import annotations

from typing import Any, Literal

# Error codes no retry mends → the field to fix. A HEAD answer has no body: its code is the HTTP status.
CONFIG_ERRORS = {
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
CA_FIELD = "bucket.credentials.aws_client_parameters.verify_cert_path"
ENDPOINT_FIELD = "bucket.credentials.aws_client_parameters.endpoint_url"

Kind = Literal["configuration", "transient"]


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


def explain(exc: BaseException, where: str) -> tuple[Kind, str] | None:
    """``(kind, message)`` for an error of the store at ``where`` that has a meaning of its own, else None."""
    code = error_code(exc)
    if code in CONFIG_ERRORS:
        return "configuration", f"{where}: {code}: {CONFIG_ERRORS[code]}"
    refusal = tls_refusal(exc)
    if refusal == "CERTIFICATE_VERIFY_FAILED":
        return "configuration", (
            f"{where}: the store's TLS certificate is not trusted ({exc}): set {CA_FIELD} to the certificate (PEM) "
            f"of the CA that signed it, or fix the host in {ENDPOINT_FIELD}"
        )
    if refusal:
        return (
            "configuration",
            f"{where}: the endpoint does not speak TLS ({exc}): fix {ENDPOINT_FIELD} (http://, or "
            "the store's https port)",
        )
    if type(exc).__name__ == "RetriesExceededError":  # s3transfer gave up; it keeps no __cause__
        return "transient", f"{where}: the transfer failed after retries: {getattr(exc, 'last_exception', None)!r}"
    return None
