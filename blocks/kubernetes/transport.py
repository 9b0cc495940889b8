"""The HTTP under gpuferry's Kubernetes client (``blocks/kubernetes/api.py``): bounded retries of transient failures,
and the API server's refusals as errors that say what to do.

Retries (``tenacity``) are made under the ``ApiClient``, in place of its ``rest_client``, so that every request is
covered, discovery's included: a connection error, a timeout (connect: 10 s at most; read: ``timeout``), or a
429/500/502/503/504 answer is retried up to ``retries`` times, each after ``blocks.base.backoff.retry_delay`` (plus
the answer's ``Retry-After``, at most 10 s); then ``TransientError``. Every method is retried alike: the calls here
are idempotent (GET, server-side apply, DELETE, a PUT with a resourceVersion) or safe to repeat (a repeated create
answers 409, a SelfSubjectAccessReview stores nothing). A 500 "failed to create typed patch object" (the server
cannot merge the object, and the same body fails again) is not retried. ``urllib3``'s own retries are off
(``Configuration.retries = False``): one attempt is one HTTP request.

``error`` and ``conflict`` turn a refusal into ``KubeApiError`` (``NotFound``, ``ApplyConflict``) with the fix in its
message: 401/403 name the kubeconfig's user and RBAC, 422 the rejected object, a server-side apply conflict the
field manager that owns the fields.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import tenacity

from blocks.base.backoff import retry_delay
from blocks.errors import ConfigurationError, GpuferryError, TransientError

if TYPE_CHECKING:
    from kubernetes.client.rest import RESTResponse

_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_UNAPPLIABLE = "failed to create typed patch object"  # a 500 that the same body gets again


class KubeApiError(GpuferryError):
    """The API server refused a request (4xx other than the transient ones)."""

    def __init__(self, message: str, *, status: int, reason: str = "", body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.body = body or {}


class NotFound(KubeApiError):
    """404: the object (or the API) does not exist."""


class ApplyConflict(KubeApiError, ConfigurationError):
    """409 on server-side apply: another field manager owns a field we set."""


class NoAnswer(TransientError):
    """A request through the API server's proxy was sent, and no answer came (a timeout, a dropped connection)."""

    def __init__(self, where: str, cause: str) -> None:
        super().__init__(f"{where}: no answer ({cause})")
        self.cause = cause


class _Retry(Exception):
    """One attempt failed in a way the next may not: retried."""

    def __init__(self, text: str, retry_after: float = 0.0) -> None:
        super().__init__(text)
        self.retry_after = retry_after


class Transport:
    """Stands in for the ``ApiClient``'s ``rest_client``: every request the ``ApiClient`` sends (``DynamicClient``'s,
    discovery's) goes through ``request``, which retries transient failures."""

    def __init__(self, rest: Any, *, timeout: float, retries: int, backoff: float) -> None:
        self.rest = rest
        self.timeout = (min(timeout, 10.0), timeout)  # (connect, read)
        self.retries = retries
        self.backoff = backoff
        self.attempts = 0  # every HTTP attempt made (tests read it)

    def close(self) -> None:
        self.rest.close()

    def _retrying(self, retry_on: type[BaseException]) -> tenacity.Retrying:
        def wait(state: tenacity.RetryCallState) -> float:
            failure = state.outcome.exception() if state.outcome else None
            return retry_delay(state.attempt_number, self.backoff) + getattr(failure, "retry_after", 0.0)

        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=wait,
            retry=tenacity.retry_if_exception_type(retry_on),
            reraise=True,
        )

    def _send(self, method: str, url: str, headers: Any, body: Any, post_params: Any, timeout: Any) -> RESTResponse:
        self.attempts += 1
        response = self.rest.request(
            method, url, headers=headers, body=body, post_params=post_params, _request_timeout=timeout or self.timeout
        )
        response.read()  # the body inside the attempt: a read that times out is retried too
        return response

    def request(
        self,
        method: str,
        url: str,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> RESTResponse:
        """``RESTClientObject.request``, retried: connection errors, timeouts and transient statuses."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        def attempt() -> RESTResponse:
            try:
                response = self._send(method, url, headers, body, post_params, _request_timeout)
            except (urllib3.exceptions.TimeoutError, urllib3.exceptions.ProtocolError) as exc:
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
            except ApiException as exc:
                if exc.status == 0:  # the client's wrapping of a TLS error
                    raise _Retry(" ".join(str(exc.reason).split())) from exc
                raise
            if response.status in _TRANSIENT_STATUS and _UNAPPLIABLE not in text_of(response.data):
                wait = response.headers.get("Retry-After", "")
                raise _Retry(
                    f"HTTP {response.status}: {status_message(response.data)}",
                    retry_after=min(int(wait), 10) if wait.isdigit() else 0.0,
                )
            return response

        try:
            return self._retrying(_Retry)(attempt)
        except _Retry as exc:
            raise TransientError(
                f"{method} {url.split('?', 1)[0]} failed {self.retries + 1} times; last: {exc}. "
                "Is the API server up and reachable?"
            ) from None

    def proxy(self, method: str, url: str, headers: Any, body: Any, timeout: float | None) -> RESTResponse:
        """One request whatever its answer; only failing to reach the API server is retried."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        read_timeout = (min(timeout, 10.0), timeout) if timeout is not None else None

        def attempt() -> RESTResponse:
            try:
                return self._send(method, url, headers, body, None, read_timeout)
            except urllib3.exceptions.ConnectTimeoutError as exc:  # NewConnectionError included
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
            except ApiException as exc:
                if exc.status == 0:  # TLS, on connecting
                    raise _Retry(" ".join(str(exc.reason).split())) from exc
                raise
            except (urllib3.exceptions.TimeoutError, urllib3.exceptions.ProtocolError) as exc:
                raise NoAnswer(f"{method} {url}", f"{type(exc).__name__}: {exc}") from None

        try:
            return self._retrying(_Retry)(attempt)
        except _Retry as exc:
            raise TransientError(f"{method} {url}: cannot reach the API server ({exc})") from None


def text_of(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def error_body(raw: Any) -> dict[str, Any]:
    text = text_of(raw) if isinstance(raw, bytes) else str(raw or "")
    try:
        body = json.loads(text)
    except ValueError:
        return {"message": text[:500]}
    return body if isinstance(body, dict) else {"message": str(body)}


def status_message(raw: bytes | None) -> str:
    text = text_of(raw)
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    return str(body.get("message") or body)[:500] if isinstance(body, dict) else str(body)[:300]


def conflict(where: str, exc: KubeApiError) -> ApplyConflict:
    path = where.split(" ", 1)[-1]
    causes = exc.body.get("details", {}).get("causes", [])
    owners = "; ".join(f"{c.get('field', '?')}: {c.get('message', '')}" for c in causes) or exc.body.get("message")
    return ApplyConflict(
        f"server-side apply conflict on {path}: fields we set are owned by another field manager ({owners}). "
        "Let that manager give them up (or remove them from its configuration), or set force_conflicts=true "
        "on the KubernetesCluster block to take them over",
        status=exc.status,
        reason=exc.reason,
        body=exc.body,
    )


def error(where: str, status: int, raw: Any) -> KubeApiError:
    body = error_body(raw)
    reason, message = body.get("reason", ""), body.get("message", "")
    if status == 404:
        return NotFound(f"{where}: not found: {message}", status=status, reason=reason, body=body)
    if status == 500 and _UNAPPLIABLE in message:
        return KubeApiError(
            f"{where}: the API server cannot apply this object: {message}",
            status=status,
            reason=reason or "InternalError",
            body=body,
        )
    if status in (401, 403):
        return KubeApiError(
            f"{where}: {'not authenticated' if status == 401 else 'forbidden'}: {message}. "
            "Check the kubeconfig's user and its RBAC permissions in the namespace",
            status=status,
            reason=reason,
            body=body,
        )
    if status == 422:
        return KubeApiError(
            f"{where}: the API server rejected the object: {message}", status=status, reason=reason, body=body
        )
    return KubeApiError(f"{where}: HTTP {status} {reason}: {message}", status=status, reason=reason, body=body)
