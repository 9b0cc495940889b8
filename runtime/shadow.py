"""Shadow traffic: a copy of a share of the ``/invocations`` requests goes to another version of the model, and
the two answers are compared; clients only ever receive this server's answers.

The server (``runtime/serve.py``) copies a request once its own answer has been sent: a client never waits for a
copy, and a slow or failing shadow never changes an answer. Settings (environment):

``SHADOW_URL``           The other version's scoring URL, ``http://host:port/invocations``. Unset: no copies.
``SHADOW_SHARE``         The share of requests copied, above 0 and at most 1 (1). The copies are spread evenly:
                         with 0.25, every fourth request.
``SHADOW_RTOL``          Two numbers agree when they differ by at most this share of the larger (1e-6) ...
``SHADOW_ATOL``          ... or by at most this much (0). Strings, booleans and nulls (classes, labels) must be equal.
``SHADOW_TIMEOUT_S``     How long a copy may take (5 s); past it the copy counts as unanswered.
``SHADOW_MAX_INFLIGHT``  Copies under way at once (8); a request that finds them all busy is not copied (counted
                         as skipped), so a slow shadow costs this server a bounded number of threads and nothing else.

What it measures, on the server's ``/metrics`` (``Shadow.render``): the shadow's answers by HTTP status code
(``none``: no answer in time), their latency as this server saw it, the rows compared by result (``agree`` or
``disagree``; a row is one element of ``predictions`` when both answers have as many, else the whole answer)
and the requests not copied. Rows are compared only when both versions answered 200.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.jsonio import loads
from runtime.metrics import Histogram, latency_histogram

log = logging.getLogger("runtime.shadow")

URL_ENV = "SHADOW_URL"
SHARE_ENV = "SHADOW_SHARE"
RTOL_ENV = "SHADOW_RTOL"
ATOL_ENV = "SHADOW_ATOL"
TIMEOUT_ENV = "SHADOW_TIMEOUT_S"
MAX_INFLIGHT_ENV = "SHADOW_MAX_INFLIGHT"


@dataclass(frozen=True)
class ShadowSettings:
    """Where copies go and how answers are compared (the ``SHADOW_*`` variables)."""

    url: str
    share: float = 1.0
    rtol: float = 1e-6
    atol: float = 0.0
    timeout_s: float = 5.0
    max_inflight: int = 8

    @classmethod
    def from_env(cls, env: MutableMapping[str, str]) -> ShadowSettings | None:
        """The settings, or None when ``SHADOW_URL`` is not set; ValueError naming the variable when one is bad."""
        url = env.get(URL_ENV, "").strip()
        if not url:
            return None
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"{URL_ENV}={url!r} must be an http URL such as http://model-v2:8080/invocations")

        def number(name: str, default: float, low: float, high: float, kind: type[int] | type[float] = float) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if not (math.isfinite(value) and low <= value <= high) or (name == SHARE_ENV and value == 0):
                bounds = "above 0 and at most 1" if name == SHARE_ENV else f"between {low:g} and {high:g}"
                raise ValueError(f"{name}={raw!r} must be {bounds}")
            return value

        return cls(
            url=url,
            share=number(SHARE_ENV, cls.share, 0, 1),
            rtol=number(RTOL_ENV, cls.rtol, 0, 1),
            atol=number(ATOL_ENV, cls.atol, 0, math.inf),
            timeout_s=number(TIMEOUT_ENV, cls.timeout_s, 0.001, 3600),
            max_inflight=number(MAX_INFLIGHT_ENV, cls.max_inflight, 1, 1024, int),
        )

    @classmethod
    def from_fields(cls, fields: MutableMapping[str, Any]) -> ShadowSettings | None:
        """The same from a JSON object's fields (``url``, ``share``, ...: the variables' names without
        ``SHADOW_``), as the front's shadow file and the route file hold them."""
        return cls.from_env({f"SHADOW_{k.upper()}": str(v) for k, v in fields.items()})


def agree(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """Whether two decoded answers (or parts of them) agree: numbers within the tolerances (NaN agrees with
    NaN), everything else equal, lists and objects element by element."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None or isinstance(a, str):
        return a == b and type(a) is type(b)
    if isinstance(a, int | float) and isinstance(b, int | float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(agree(x, y, rtol, atol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(agree(a[k], b[k], rtol, atol) for k in a)
    return False


def compare(mine: bytes, theirs: bytes, rtol: float, atol: float) -> tuple[int, int]:
    """(rows that agree, rows that do not) between two scoring answers: row by row when both carry a list of
    ``predictions`` of one length, else the answers as one row. An answer that is not JSON disagrees."""
    try:
        a, b = loads(mine), loads(theirs)
    except ValueError:
        return (1, 0) if mine == theirs else (0, 1)
    rows_a = a.get("predictions") if isinstance(a, dict) else None
    rows_b = b.get("predictions") if isinstance(b, dict) else None
    if isinstance(rows_a, list) and isinstance(rows_b, list) and len(rows_a) == len(rows_b) and rows_a:
        agreeing = sum(agree(x, y, rtol, atol) for x, y in zip(rows_a, rows_b, strict=True))
        return agreeing, len(rows_a) - agreeing
    return (1, 0) if agree(a, b, rtol, atol) else (0, 1)


Posted = tuple[str, bytes, float, str | None]  # status code or "none", body, seconds, content type


class Poster:
    """POSTs bodies to one URL from a small thread pool, one kept-alive connection per thread; what the shadow's
    copies and a canary's requests (``runtime/route.py``) are sent with."""

    def __init__(self, url: str, timeout_s: float, threads: int, name: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self._host, self._port = parts.hostname or "", parts.port or 80
        self._path = parts.path or "/"
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
            self._local.connection = connection
        return connection

    def post(self, body: bytes, content_type: str | None) -> Posted:
        """POST one body (on a pool thread): (status code or ``none``: no answer, body, seconds, content type)."""
        headers = {"Content-Type": content_type or "application/json", "Content-Length": str(len(body))}
        started = time.perf_counter()
        for attempt in range(2):  # a kept connection the other side closed while idle is opened again once
            connection = self._connection()
            try:
                connection.request("POST", self._path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                if response.will_close:
                    connection.close()
                kind = response.getheader("Content-Type")
                return str(response.status), data, time.perf_counter() - started, kind
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as exc:
                connection.close()
                if attempt or time.perf_counter() - started > self.timeout_s:
                    log.debug("POST to %s:%s failed: %s", self._host, self._port, exc)
                    break
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, unreadable
                connection.close()
                log.debug("POST to %s:%s failed: %s", self._host, self._port, exc)
                break
        return "none", b"", time.perf_counter() - started, None


class Shadow:
    """Copies requests to the shadow and keeps the counts. ``offer`` is called on the event loop; the copies are
    sent from a small thread pool (one kept-alive connection per thread)."""

    def __init__(self, settings: ShadowSettings) -> None:
        self.settings = settings
        self._poster = Poster(settings.url, settings.timeout_s, settings.max_inflight, "shadow")
        self._credit = 0.0
        self._inflight = 0
        self._pending: set[asyncio.Future[None]] = set()
        self.codes: dict[str, int] = {}
        self.rows = {"agree": 0, "disagree": 0}
        self.skipped = 0
        self.latency: Histogram = latency_histogram(
            "inference_shadow_request_duration_seconds", "Time the shadow took to answer a copied request."
        )

    def offer(self, body: bytes, content_type: str | None, status: int, answer: bytes) -> None:
        """A request this server answered (``status``, ``answer``): copy it when its turn comes."""
        self._credit += self.settings.share
        if self._credit < 1.0 - 1e-9:
            return
        self._credit -= 1.0
        if self._inflight >= self.settings.max_inflight:
            self.skipped += 1
            return
        self._inflight += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._poster.pool, self._poster.post, body, content_type)
        task = asyncio.ensure_future(self._settle(future, status, answer))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(self, future: asyncio.Future[Posted], status: int, answer: bytes) -> None:
        try:
            code, theirs, seconds, _ = await future
        finally:
            self._inflight -= 1
        self.codes[code] = self.codes.get(code, 0) + 1
        if code != "none":
            self.latency.observe(seconds)
        if status == 200 and code == "200":
            agreeing, not_agreeing = compare(answer, theirs, self.settings.rtol, self.settings.atol)
            self.rows["agree"] += agreeing
            self.rows["disagree"] += not_agreeing

    async def close(self) -> None:
        """Wait for the copies under way (each bounded by its timeout), then stop the threads."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        self._poster.pool.shutdown(wait=False, cancel_futures=True)

    def render(self) -> list[str]:
        """Its Prometheus lines."""
        return [
            "# HELP inference_shadow_requests_total Copies sent to the shadow, by its HTTP status code (none: no "
            "answer in time).",
            "# TYPE inference_shadow_requests_total counter",
            *(f'inference_shadow_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.codes.items())),
            *self.latency.render(),
            "# HELP inference_shadow_rows_total Rows of the answers compared, by result (both versions answered 200).",
            "# TYPE inference_shadow_rows_total counter",
            *(f'inference_shadow_rows_total{{result="{r}"}} {n}' for r, n in self.rows.items()),
            "# HELP inference_shadow_skipped_total Requests not copied: every copy slot was busy.",
            "# TYPE inference_shadow_skipped_total counter",
            f"inference_shadow_skipped_total {self.skipped}",
        ]
