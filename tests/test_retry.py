"""Which errors are retried: transient ones only."""

from __future__ import annotations

import errno

import botocore.exceptions
import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

from blocks.errors import ConfigurationError, JobFailed, TransientError
from tasks.retry import is_transient


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def _http_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1/")
    return httpx.HTTPStatusError("x", request=request, response=httpx.Response(status, request=request))


TRANSIENT = [
    TransientError("x"),
    ConnectionResetError(),
    ConnectionRefusedError(),
    TimeoutError(),
    OSError(errno.EHOSTUNREACH, "no route"),
    httpx.ConnectError("refused"),
    httpx.ReadTimeout("slow"),
    _http_error(503),
    _http_error(429),
    _client_error("SlowDown", 503),
    _client_error("Throttling", 400),
    _client_error("BadDigest", 400),
    _client_error("XAmzContentSHA256Mismatch", 400),
    botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE),
]
PERMANENT = [
    ValueError("bad"),
    ConfigurationError("resources.nodes=2: ..."),
    JobFailed("failed", state="FAILED", exit_code=1),
    PermissionError(errno.EACCES, "denied"),
    FileNotFoundError(),
    _http_error(401),
    _http_error(403),
    _http_error(404),
    _client_error("AccessDenied", 403),
    _client_error("InvalidAccessKeyId", 403),
    _client_error("SignatureDoesNotMatch", 403),
    MlflowException("bad", error_code=INVALID_PARAMETER_VALUE),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_wrapped_cause_counts() -> None:
    try:
        try:
            raise ConnectionResetError()
        except ConnectionResetError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)
