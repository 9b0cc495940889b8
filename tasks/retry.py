"""Which errors are worth another attempt, and the retry options of a task.

Transient: the outside system hiccuped — connection refused/reset, timeouts, HTTP 5xx or 429,
throttling. Never transient: validation, configuration, authentication and authorization errors:
retrying those only delays the message the user needs.

Each task states its own policy with ``retry_options(...)``: how many attempts, the backoff, and
any extra error types that are transient *for that step*.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

from prefect.tasks import exponential_backoff

from blocks.errors import GpuferryError, TransientError

_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
    errno.EAGAIN,
}
_THROTTLING_CODES = {
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestLimitExceeded",
    "SlowDown",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "InternalFailure",
    "REQUEST_LIMIT_EXCEEDED",
    "TEMPORARILY_UNAVAILABLE",
    # S3: the body arrived other than it was sent (its Content-MD5, CRC32 or signed sha256 does not match).
    "BadDigest",
    "XAmzContentSHA256Mismatch",
}


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status carried by the common client libraries' errors, if any."""
    for attr in ("status_code", "status", "http_status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    if response is not None:
        if isinstance(response, dict):  # botocore ClientError
            return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        value = getattr(response, "status_code", None)
        if isinstance(value, int):
            return value
    return None


def is_transient(exc: BaseException) -> bool:
    """True when a later attempt may succeed."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, GpuferryError):
        return False  # ours, and not marked transient: a configuration or job failure
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    name = type(exc).__name__
    module = type(exc).__module__
    if module.startswith("httpx") and name in {
        "ConnectError",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        "ConnectTimeout",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
    }:
        return True
    if module.startswith(("requests", "urllib3")) and name in {
        "ConnectionError",
        "ConnectTimeout",
        "ReadTimeout",
        "ProtocolError",
        "NewConnectionError",
    }:
        return True
    if module.startswith("botocore") and name in {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
    }:
        return True
    if module.startswith("mlflow") and name == "RestException" and getattr(exc, "error_code", "") == "INTERNAL_ERROR":
        return True  # the tracking server answered 5xx
    if module.startswith("mlflow") and "Max retries exceeded" in str(exc):
        return True  # MLflow's own HTTP retries gave up on a connection error
    code = getattr(exc, "error_code", None)  # MLflow
    if code is None and hasattr(exc, "response") and isinstance(exc.response, dict):
        code = exc.response.get("Error", {}).get("Code")  # botocore
    if code in _THROTTLING_CODES:
        return True
    status = _http_status(exc)
    if status is not None:
        return status == 429 or status >= 500
    # An error wrapped with ``raise ... from`` keeps the original as its cause.
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_transient(cause)


def _exception_of(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - we classify whatever the task raised
        return exc
    return None


def retry_condition(extra_transient: tuple[type[BaseException], ...] = ()) -> Callable[[Any, Any, Any], bool]:
    """A Prefect ``retry_condition_fn`` that retries transient errors only."""

    def should_retry(_task: Any, _task_run: Any, state: Any) -> bool:
        exc = _exception_of(state)
        return exc is not None and (isinstance(exc, extra_transient) or is_transient(exc))

    return should_retry


def retry_options(
    retries: int = 4,
    backoff_seconds: float = 2.0,
    jitter: float = 0.5,
    extra_transient: tuple[type[BaseException], ...] = (),
) -> dict[str, Any]:
    """Task options: exponential backoff with jitter, only on transient errors."""
    return {
        "retries": retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=backoff_seconds),
        "retry_jitter_factor": jitter,
        "retry_condition_fn": retry_condition(extra_transient),
    }
