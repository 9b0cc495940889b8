"""Where a share of the ``/invocations`` requests goes besides this server, set while the server runs: a canary
(another version answers the share, and its answers are the clients') or a shadow (a copy of the share goes to
another version once this server answered, ``runtime/shadow.py``).

``ROUTE_FILE`` names a JSON file the server reads again whenever it changes (checked at most twice a second, and
on every ``/metrics``); on Kubernetes it is a key of a ConfigMap mounted into the pods, which the kubelet
replaces as a whole. Its forms::

    {"generation": 7}                                                    nothing but this server
    {"generation": 8, "canary": {"url": "http://svc/invocations", "share": 0.1}}
    {"generation": 9, "shadow": {"url": "http://svc/invocations", "share": 0.5, "rtol": 1e-6, "atol": 0}}

``generation`` is the number the server reports on ``/metrics`` (``inference_route_generation``) once it applies
the file: whoever wrote it knows when every replica took it. A file that cannot be read or is not one of these
forms is logged and the last good one kept; no file: nothing (or the ``SHADOW_*`` variables' shadow).

A canary's request that gets no answer (refused, reset, past ``timeout_s``, 10 s by default) or a 503 (the canary
not ready, overloaded or draining) is answered by this server instead, so a canary that is removed costs no
client a failed request. Every canary answer is counted by its status code (``none``: no answer) in
``inference_route_requests_total``; requests answered here are this server's own (``inference_requests_total``).
At most ``max_inflight`` (32) canary requests are under way at once; past that a request is answered here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from runtime.shadow import Poster, Shadow, ShadowSettings
from runtime.watched import WatchedFile

log = logging.getLogger("runtime.route")

CHECK_EVERY_S = 0.5


@dataclass(frozen=True)
class CanarySettings:
    url: str
    share: float
    timeout_s: float = 10.0
    max_inflight: int = 32

    @classmethod
    def parse(cls, wanted: dict[str, Any]) -> CanarySettings:
        """From the route file's ``canary`` object; ValueError naming the field when one is bad."""
        unknown = sorted(set(wanted) - {"url", "share", "timeout_s", "max_inflight"})
        if unknown:
            raise ValueError(f"canary: unknown field(s) {', '.join(unknown)}")
        url = str(wanted.get("url", ""))
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"canary.url={url!r} must be an http URL such as http://model-v2:8080/invocations")
        share, timeout = wanted.get("share"), wanted.get("timeout_s", cls.timeout_s)
        inflight = wanted.get("max_inflight", cls.max_inflight)
        if not isinstance(share, int | float) or not (0 < share <= 1):
            raise ValueError(f"canary.share={share!r} must be a number above 0 and at most 1")
        if not isinstance(timeout, int | float) or not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"canary.timeout_s={timeout!r} must be a number of seconds above 0")
        if not isinstance(inflight, int) or not (1 <= inflight <= 1024):
            raise ValueError(f"canary.max_inflight={inflight!r} must be a whole number from 1 to 1024")
        return cls(url=url, share=float(share), timeout_s=float(timeout), max_inflight=inflight)


class Canary:
    """Sends every ``1/share``-th request to the canary (evenly spaced, as the shadow's copies are) and gives
    back its answer; None when it gave none that a client should get."""

    def __init__(self, settings: CanarySettings) -> None:
        self.settings = settings
        self._poster = Poster(settings.url, settings.timeout_s, settings.max_inflight, "canary")
        self._credit = 0.0
        self._inflight = 0
        self.codes: dict[str, int] = {}

    def take(self) -> bool:
        """Whether this request is the canary's."""
        self._credit += self.settings.share
        if self._credit < 1.0 - 1e-9:
            return False
        self._credit -= 1.0
        return self._inflight < self.settings.max_inflight

    async def send(self, body: bytes, content_type: str | None) -> tuple[int, bytes, str | None] | None:
        """The canary's (status, body, content type), or None: answer it here."""
        self._inflight += 1
        try:
            loop = asyncio.get_running_loop()
            code, data, _, kind = await loop.run_in_executor(self._poster.pool, self._poster.post, body, content_type)
        finally:
            self._inflight -= 1
        self.codes[code] = self.codes.get(code, 0) + 1
        if code in ("none", "503"):
            return None
        return int(code), data, kind

    async def close(self) -> None:
        self._poster.pool.shutdown(wait=False, cancel_futures=True)


class Route:
    """The route in force: ``canary`` or ``shadow`` (at most one), from the route file when ``path`` is set and
    it names one, else the ``SHADOW_*`` variables' shadow (``static``)."""

    def __init__(self, path: str | None, static: ShadowSettings | None = None) -> None:
        self.path = path
        self.generation = 0
        self._static = Shadow(static) if static is not None else None
        self.shadow: Shadow | None = self._static
        self.canary: Canary | None = None
        self._file = WatchedFile(path) if path is not None else None
        self._checked = -math.inf
        self._retired: list[Shadow | Canary] = []

    def refresh(self, force: bool = False) -> None:
        """Read the file again when it changed (at most every ``CHECK_EVERY_S`` unless ``force``)."""
        if self._file is None:
            return
        now = time.monotonic()
        if not force and now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        if not self._file.changed():  # a ConfigMap volume swaps a symlink: a change too
            return
        try:
            text = self._file.read()
            generation, canary, shadow = parse(json.loads(text)) if text is not None else (0, None, None)
        except (OSError, ValueError) as exc:  # keep the last good one
            log.error("route file %s: %s", self.path, exc)
            return
        self._apply(generation, canary, shadow)

    def _apply(self, generation: int, canary: CanarySettings | None, shadow: ShadowSettings | None) -> None:
        if canary != (self.canary.settings if self.canary else None):
            if self.canary is not None:
                self._retired.append(self.canary)
            self.canary = Canary(canary) if canary is not None else None
            log.info(
                "%s", f"the canary {canary.url} answers {canary.share:g} of the requests" if canary else "no canary"
            )
        wanted = shadow or (self._static.settings if self._static else None)
        if wanted != (self.shadow.settings if self.shadow else None):
            if self.shadow is not None and self.shadow is not self._static:
                self._retired.append(self.shadow)
            self.shadow = (
                self._static if self._static and wanted == self._static.settings else Shadow(wanted) if wanted else None
            )
            log.info(
                "%s", f"copying {wanted.share:g} of the requests to the shadow {wanted.url}" if wanted else "no shadow"
            )
        self.generation = generation
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # read outside the server (a test): nothing under way to wait for
            self._retired.clear()
        for old in self._retired:
            asyncio.ensure_future(old.close())
        self._retired.clear()

    async def close(self) -> None:
        for part in (self.canary, self.shadow):
            if part is not None:
                await part.close()

    def render(self) -> list[str]:
        """Its Prometheus lines (the shadow's are ``Shadow.render``'s)."""
        codes = self.canary.codes if self.canary is not None else {}
        return [
            "# HELP inference_route_generation The route file's generation this server applies (0: none).",
            "# TYPE inference_route_generation gauge",
            f"inference_route_generation {self.generation}",
            "# HELP inference_route_requests_total Requests sent to the canary, by its HTTP status code (none: no "
            "answer; none and 503 were answered here).",
            "# TYPE inference_route_requests_total counter",
            *(f'inference_route_requests_total{{code="{c}"}} {n}' for c, n in sorted(codes.items())),
        ]


def parse(wanted: Any) -> tuple[int, CanarySettings | None, ShadowSettings | None]:
    """(generation, canary, shadow) of a route file's content; ValueError naming what is wrong."""
    if not isinstance(wanted, dict):
        raise ValueError("the route file must hold a JSON object")
    unknown = sorted(set(wanted) - {"generation", "canary", "shadow"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}: use generation, canary or shadow")
    generation = wanted.get("generation", 0)
    if not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation={generation!r} must be a whole number of at least 0")
    if "canary" in wanted and "shadow" in wanted:
        raise ValueError("set canary or shadow, not both")
    canary = CanarySettings.parse(wanted["canary"]) if isinstance(wanted.get("canary"), dict) else None
    shadow = None
    if isinstance(wanted.get("shadow"), dict):
        fields = wanted["shadow"]
        unknown = sorted(set(fields) - {"url", "share", "rtol", "atol", "timeout_s", "max_inflight"})
        if unknown:
            raise ValueError(f"shadow: unknown field(s) {', '.join(unknown)}")
        shadow = ShadowSettings.from_fields(fields)
        if shadow is None:
            raise ValueError("shadow.url is missing")
    for key in ("canary", "shadow"):
        if key in wanted and not isinstance(wanted[key], dict):
            raise ValueError(f"{key} must be a JSON object")
    return generation, canary, shadow
