"""The front of a service on one Docker host: a fixed address that forwards each HTTP request to the version
serving now. gpuferry's ``DockerServing`` runs it as a container of its own, from the image of a version, on
the Docker network of the versions; it needs nothing but Python's standard library.

``python -m runtime.front`` listens on ``FRONT_PORT`` (8000) and forwards every request to ``host:port``, read
from the file ``FRONT_TARGET_FILE`` (/tmp/gpuferry-front/target), or from ``FRONT_TARGET`` while that file does
not exist. ``python -m runtime.front set HOST:PORT``, run in the front's container (``docker exec``), replaces
the file at once (a rename); the front reads it again whenever it changed, so every request that starts after
``set`` returned goes to the new target, and requests under way finish where they started. With several targets
and their weights (``set v1:8080=9 v2:8080=1``, a canary) each request goes to one of them, spread by weight
and evenly spaced: with 9 and 1, every tenth request goes to the second.

Shadow traffic: ``python -m runtime.front shadow URL SHARE [RTOL [ATOL]]`` (``shadow off`` to stop) makes the
front copy a share of the ``POST /invocations`` requests to another version once their answer has been sent
(``runtime/shadow.py``, with its settings; the file ``FRONT_SHADOW_FILE``, /tmp/gpuferry-front/shadow); the
answers are compared and the counts written next to it every 0.5 s, which ``python -m runtime.front stats``
prints (Prometheus text). Clients only ever get the target's answers. Only bodies of up to 64 KiB, answered
with a Content-Length of up to 64 KiB, are copied.

Each request picks its upstream connection when it starts: an idle one to the current target (kept for at
most 1 s idle, and only for the target of the moment: a switch closes the others), else a new one. Nothing
pins a client to a version, and a client's keep-alive connection to the front outlives any number of
switches. A kept connection that the version had closed before reading the request (its idle timeout) is
tried once more on a new one (bodies up to 64 KiB are held for that); a target that refuses connections (a
version the engine restarts) is tried again, against the target of that moment, for
``FRONT_CONNECT_TIMEOUT`` seconds (10); then the answer is 502. Requests and responses keep their framing
(Content-Length or chunked); ``Expect: 100-continue`` is answered by the front. HTTP/1.1 and 1.0 only: no
upgrade to WebSocket or HTTP/2. SIGTERM stops accepting, lets requests under way finish for up to
``FRONT_DRAIN_SECONDS`` (5) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from runtime.watched import WatchedFile, replace_file

PORT_ENV = "FRONT_PORT"
TARGET_ENV = "FRONT_TARGET"
TARGET_FILE_ENV = "FRONT_TARGET_FILE"
CONNECT_TIMEOUT_ENV = "FRONT_CONNECT_TIMEOUT"
DRAIN_ENV = "FRONT_DRAIN_SECONDS"
SHADOW_FILE_ENV = "FRONT_SHADOW_FILE"
DEFAULT_PORT = 8000
DEFAULT_TARGET_FILE = "/tmp/gpuferry-front/target"
DEFAULT_SHADOW_FILE = "/tmp/gpuferry-front/shadow"
STATS_SUFFIX = ".prom"  # the shadow's counts, next to its settings file: FRONT_SHADOW_FILE + .prom
SHADOW_PATH = b"/invocations"

MAX_HEAD = 64 * 1024  # request line and headers
CHUNK = 64 * 1024
BUFFERED = 64 * 1024  # a body up to this size is read whole and sent with its head in one write
KEEP_IDLE_S = 1.0  # an upstream connection idle longer is not used again (servers close idle ones: uvicorn after 5 s)
KEEP_MAX = 64  # idle upstream connections kept at most
IDLE_TIMEOUT_S = 75.0  # a client's keep-alive connection with no request for this long is closed
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"upgrade", b"te", b"expect"})
NO_BODY_STATUS = frozenset({204, 304})

log = logging.getLogger("gpuferry.front")


class BadRequest(Exception):
    """The client's request cannot be forwarded: answered with ``status`` and the connection closed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def parse_target(text: str) -> tuple[str, int]:
    """``host:port`` → (host, port); ValueError when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise ValueError(f"{text.strip()!r} is not host:port")
    return host, int(port)


Address = tuple[str, int]
Weighted = tuple[Address, float]


def parse_targets(text: str) -> list[Weighted]:
    """The target file's lines, ``host:port`` or ``host:port weight`` (a weight above 0; 1 when left out), one per
    version → [((host, port), weight)]; ValueError when a line is not one, or names a version twice."""
    out: list[Weighted] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        address, _, weight_text = line.strip().partition(" ")
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            weight = -1.0
        if not (0 < weight < float("inf")):
            raise ValueError(f"{line.strip()!r}: the weight must be a number above 0")
        target = parse_target(address)
        if any(target == t for t, _ in out):
            raise ValueError(f"{address!r} is named twice")
        out.append((target, weight))
    if not out:
        raise ValueError("no target")
    return out


class Target:
    """The current targets: the file when it exists (read again when it changed), else the variable. With several,
    ``pick`` spreads the requests by weight (smooth weighted round robin: with weights 9 and 1, the second gets
    every tenth request, evenly spaced)."""

    def __init__(self, path: str, fallback: str | None) -> None:
        self.path = path
        self.fallback: list[Weighted] | None = [(parse_target(fallback), 1.0)] if fallback else None
        self._file = WatchedFile(path)
        self._value: list[Weighted] | None = None
        self._credit: dict[Address, float] = {}

    def get(self) -> list[Weighted] | None:
        if self._file.changed():
            try:
                text = self._file.read()
                value = parse_targets(text) if text is not None else None
            except (OSError, ValueError) as exc:  # keep the last good one
                log.error("target file %s: %s", self.path, exc)
            else:
                if value is not None and value != self._value:  # None: the file went, the last targets stay
                    log.info("forwarding to %s", ", ".join(f"{h}:{p} ({w:g})" for (h, p), w in value))
                    self._credit = {}
                    self._value = value
        return self._value or self.fallback

    def pick(self) -> Address | None:
        """The target of the next request."""
        targets = self.get()
        if not targets:
            return None
        if len(targets) == 1:
            return targets[0][0]
        total = sum(w for _, w in targets)
        for target, weight in targets:
            self._credit[target] = self._credit.get(target, 0.0) + weight
        chosen = max(targets, key=lambda t: self._credit[t[0]])[0]
        self._credit[chosen] -= total
        return chosen

    def current(self, target: Address) -> bool:
        """Whether ``target`` is one of the current targets."""
        return any(target == t for t, _ in self.get() or [])


def write_target(path: str, *targets: str) -> None:
    """Replace the target file at once; each of ``targets`` is ``host:port`` or ``host:port=weight``."""
    lines = [t.strip().replace("=", " ", 1) for t in targets]
    parse_targets("\n".join(lines))
    replace_file(path, "".join(line + "\n" for line in lines).encode(), sync=True)


class ShadowTarget:
    """Where the front copies requests to, if anywhere: the shadow file (JSON: ``url``, ``share``, ``rtol``,
    ``atol``; ``runtime/shadow.py``'s settings), read again when it changed; no file, no copies. The counts are
    written next to it (``STATS_SUFFIX``) for ``python -m runtime.front stats``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = WatchedFile(path)
        self.shadow: Any = None  # runtime.shadow.Shadow while a shadow is set
        self._written = b""

    def get(self) -> Any:
        if not self._file.changed():
            return self.shadow
        from runtime.shadow import Shadow, ShadowSettings  # only a front with a shadow needs them

        try:
            text = self._file.read()
            wanted = json.loads(text) if text is not None else {}
            if not isinstance(wanted, dict):
                raise ValueError("the shadow file must hold a JSON object")
            settings = ShadowSettings.from_fields(
                {k: v for k, v in wanted.items() if k in ("url", "share", "rtol", "atol")}
            )
        except (OSError, ValueError) as exc:  # keep the last good one
            log.error("shadow file %s: %s", self.path, exc)
            return self.shadow
        if text is None and self.shadow is not None:
            log.info("no more copies to the shadow")
        self._retire()
        if settings is not None:
            log.info("copying %g of the requests to the shadow %s", settings.share, settings.url)
            self.shadow = Shadow(settings)
        return self.shadow

    def _retire(self) -> None:
        if self.shadow is not None:
            asyncio.ensure_future(self.shadow.close())
            self.shadow = None

    def write_stats(self) -> None:
        """The shadow's counts into the stats file, when they changed (a rename: a reader never sees half)."""
        if self.shadow is None:
            return
        text = ("\n".join(self.shadow.render()) + "\n").encode()
        if text == self._written:
            return
        replace_file(f"{self.path}{STATS_SUFFIX}", text)
        self._written = text


def write_shadow(path: str, url: str, share: str, rtol: str = "1e-6", atol: str = "0") -> None:
    """Set the shadow (a rename), after checking the settings as the front will."""
    from runtime.shadow import ShadowSettings

    wanted = {"url": url, "share": share, "rtol": rtol, "atol": atol}
    ShadowSettings.from_fields(wanted)
    replace_file(path, json.dumps(wanted).encode())


# ---------------------------------------------------------------------------------------------------- HTTP


def _split_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    lines = head[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return lines[0], headers


def _values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for n, v in headers if n.lower() == name]


def _tokens(headers: list[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    return {t.strip().lower() for v in _values(headers, name) for t in v.split(b",") if t.strip()}


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[str, int]:
    """How a message's body is delimited: ("chunked", 0), ("length", n) or ("none", 0)."""
    codings = [t.strip().lower() for v in _values(headers, b"transfer-encoding") for t in v.split(b",")]
    if codings:
        if codings[-1] != b"chunked":
            raise BadRequest(400, "a transfer coding other than chunked last")
        return "chunked", 0
    lengths = {v.strip() for v in _values(headers, b"content-length")}
    if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
        raise BadRequest(400, "an invalid Content-Length")
    return ("length", int(lengths.pop())) if lengths else ("none", 0)


def _forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers without the hop-by-hop ones (and those the Connection header names)."""
    named = _tokens(headers, b"connection")
    return [(n, v) for n, v in headers if n.lower() not in HOP_BY_HOP and n.lower() not in named]


def _head(first: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    return first + b"\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n"


async def _copy_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int) -> None:
    while length:
        data = await reader.read(min(CHUNK, length))
        if not data:
            raise ConnectionError("the peer closed before the end of the body")
        writer.write(data)
        await writer.drain()
        length -= len(data)


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy a chunked body as it is (sizes, extensions, trailers), up to and with its last CRLF."""
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, f"a malformed chunk size {size_text[:20]!r}") from None
        if size == 0:
            while True:  # trailers, then the empty line
                trailer = await reader.readuntil(b"\r\n")
                writer.write(trailer)
                if trailer == b"\r\n":
                    await writer.drain()
                    return
        await _copy_length(reader, writer, size)
        crlf = await reader.readexactly(2)
        writer.write(crlf)


async def _copy_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: tuple[str, int]) -> None:
    kind, length = framing
    if kind == "chunked":
        await _copy_chunked(reader, writer)
    elif kind == "length":
        await _copy_length(reader, writer, length)


def _simple(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
        f"{len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _Stale(Exception):
    """A kept upstream connection was closed by the version before it read the request."""


Connection = tuple[tuple[str, int], asyncio.StreamReader, asyncio.StreamWriter]


class Front:
    """The proxy: one task per client connection; upstream connections kept for the current target only."""

    def __init__(self, target: Target, connect_timeout: float, shadow: ShadowTarget | None = None) -> None:
        self.target = target
        self.shadow = shadow
        self.connect_timeout = connect_timeout
        self.active = 0
        self._idle: list[tuple[Connection, float]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except BadRequest as exc:
            writer.write(_simple(exc.status, "Bad Request" if exc.status == 400 else "Error", f"{exc}\n"))
        finally:
            self.active -= 1
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Forward one request; whether the client's connection stays open for another."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            raise BadRequest(431, "the request's head is larger than 64 KiB") from None
        except (asyncio.IncompleteReadError, TimeoutError):
            return False
        first, headers = _split_head(head)
        parts = first.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise BadRequest(400, f"not an HTTP/1.x request line: {first[:80]!r}")
        method, version = parts[0], parts[2]
        framing = _framing(headers)
        connection = _tokens(headers, b"connection")
        keep_alive = b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
        if b"100-continue" in _tokens(headers, b"expect"):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the front answers it; the version never sees it
        request = _head(first, _forwarded(headers))
        body = (
            None  # a small body is read whole: sent with its head at once, and again when a kept connection was stale
        )
        if framing[0] == "none" or (framing[0] == "length" and framing[1] <= BUFFERED):
            body = await reader.readexactly(framing[1])

        upstream, status, response_first = None, 0, b""
        response_headers: list[tuple[bytes, bytes]] = []
        chosen = self.target.pick()
        for attempt in range(2):
            upstream = self._kept(chosen) if body is not None and attempt == 0 else None
            if upstream is None:
                upstream = await self._connect(chosen)
                if upstream is None:
                    writer.write(
                        _simple(
                            502,
                            "Bad Gateway",
                            "no version of the service answers (the front's target refused the connection)\n",
                        )
                    )
                    await writer.drain()
                    return False
                kept = False
            else:
                kept = True
            _, up_reader, up_writer = upstream
            try:
                try:
                    if body is not None:
                        up_writer.write(request + body)
                    else:
                        up_writer.write(request)
                        await _copy_body(reader, up_writer, framing)
                    await up_writer.drain()
                except (BrokenPipeError, ConnectionResetError):
                    raise _Stale() from None
                status, response_headers, response_first = await self._response_head(up_reader, writer)
                break
            except (_Stale, ConnectionError) as exc:
                up_writer.close()
                if kept and isinstance(exc, _Stale):
                    continue  # the version had closed that kept connection: once more, on a new one
                writer.write(
                    _simple(502, "Bad Gateway", "the service's version closed the connection without answering\n")
                )
                await writer.drain()
                return False
            except BaseException:
                up_writer.close()
                raise
        assert upstream is not None
        target, up_reader, up_writer = upstream
        reusable = b"close" not in _tokens(response_headers, b"connection") and response_first.startswith(b"HTTP/1.1")
        answer: bytes | None = None
        try:
            if method == b"HEAD" or status in NO_BODY_STATUS:
                response_body: tuple[str, int] | None = ("none", 0)
            else:
                response_body = _framing(response_headers)
                if response_body == ("none", 0):
                    response_body = None  # delimited by the end of the connection
                    keep_alive = reusable = False
            out = _forwarded(response_headers)
            if not keep_alive:
                out.append((b"connection", b"close"))
            response = _head(response_first, out)
            if response_body is None:
                writer.write(response)
                while data := await up_reader.read(CHUNK):
                    writer.write(data)
                    await writer.drain()
            elif response_body[0] != "chunked" and response_body[1] <= BUFFERED:
                answer = await up_reader.readexactly(response_body[1])
                writer.write(response + answer)
            else:
                writer.write(response)
                await _copy_body(up_reader, writer, response_body)
        except BaseException:
            up_writer.close()
            raise
        if reusable:
            self._keep((target, up_reader, up_writer))
        else:
            up_writer.close()
        await writer.drain()
        shadow = self.shadow.get() if self.shadow is not None else None
        scoring = method == b"POST" and parts[1].split(b"?", 1)[0] == SHADOW_PATH
        if shadow is not None and scoring and answer is not None and body is not None:  # answered: the copy goes out
            media = _values(headers, b"content-type")
            shadow.offer(body, media[0].decode("latin-1") if media else None, status, answer)
        return keep_alive

    def _kept(self, target: Address | None) -> Connection | None:
        """An idle connection to ``target`` that is still fresh; stale ones and those to a former target are
        closed."""
        found = None
        fresh: list[tuple[Connection, float]] = []
        for (kept_target, reader, writer), since in self._idle:
            if (
                time.monotonic() - since >= KEEP_IDLE_S
                or reader.at_eof()
                or writer.is_closing()
                or not self.target.current(kept_target)
            ):
                writer.close()
            else:
                fresh.append(((kept_target, reader, writer), since))
        for index in range(len(fresh) - 1, -1, -1):  # the most recently kept first
            if fresh[index][0][0] == target:
                found = fresh.pop(index)[0]
                break
        self._idle = fresh
        return found

    def _keep(self, upstream: Connection) -> None:
        if self.target.current(upstream[0]) and len(self._idle) < KEEP_MAX:
            self._idle.append((upstream, time.monotonic()))
        else:
            upstream[2].close()

    async def _response_head(
        self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        first_read = True
        while True:
            try:
                head = await up_reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                if first_read and not getattr(exc, "partial", b""):  # closed before a byte of an answer
                    raise _Stale() from None
                raise ConnectionError("the version closed the connection in its answer's head") from None
            except asyncio.LimitOverrunError:
                raise ConnectionError("the version's answer has a head larger than 64 KiB") from None
            first_read = False
            first, headers = _split_head(head)
            try:
                status = int(first.split(b" ", 2)[1])
            except (IndexError, ValueError):
                raise ConnectionError(f"not an HTTP response: {first[:80]!r}") from None
            if 100 <= status < 200 and status != 101:
                if status != 100:  # 100 was the front's own answer already
                    writer.write(head)
                continue
            return status, headers, first

    async def _connect(self, chosen: Address | None) -> Connection | None:
        """A new connection to ``chosen``, or, once it is no longer a target (a switch meanwhile), to the target
        of that moment; tried again for ``connect_timeout`` while it refuses."""
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.02
        target = chosen
        while True:
            if target is None or not self.target.current(target):
                target = self.target.pick()
            if target is not None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(*target, limit=MAX_HEAD), max(0.05, deadline - time.monotonic())
                    )
                    return target, reader, writer
                except (OSError, TimeoutError) as exc:
                    failure = f"{target[0]}:{target[1]}: {exc}"
            else:
                failure = "no target set"
            if time.monotonic() >= deadline:
                log.error("no connection to the target within %.0f s: %s", self.connect_timeout, failure)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


async def serve(port: int, front: Front, drain_seconds: float) -> None:
    server = await asyncio.start_server(front.handle, host="0.0.0.0", port=port, limit=MAX_HEAD)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("front listening on :%d, targets %s", port, front.target.get())
    while not stop.is_set():
        if front.shadow is not None:
            front.shadow.get()  # a shadow set or removed shows in the stats without a request
            front.shadow.write_stats()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    server.close()
    deadline = time.monotonic() + drain_seconds
    while front.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("front stopped (%d connection(s) still open)", front.active)


ROLLOUT_FILE = "rollout.json"  # a canary's or shadow's window under way: what the deploy last wrote of it
DECISION_FILE = "decision"  # promote or abort, written by hand (`gpuferry rollout`), read by the deploy
DECISIONS = ("promote", "abort")


def rollout_command(directory: str, args: list[str]) -> int:
    """The rollout's state beside the target file, for the deploy and for `gpuferry rollout`: ``set JSON``,
    ``show``, ``decide promote|abort``, ``decision``, ``clear``. Files only: the proxy never reads them."""
    state, decision = os.path.join(directory, ROLLOUT_FILE), os.path.join(directory, DECISION_FILE)
    verb, value = args[0], args[1] if len(args) > 1 else None
    if verb == "set" and value is not None:
        try:
            json.loads(value)
        except ValueError as exc:
            print(f"front: the rollout's state is not JSON: {exc}", file=sys.stderr)
            return 2
        replace_file(state, value.encode())
    elif verb == "decide" and value in DECISIONS:
        if not os.path.exists(state):
            print("front: no canary or shadow window is under way", file=sys.stderr)
            return 3
        replace_file(decision, value.encode())
    elif verb in ("show", "decision") and value is None:
        with contextlib.suppress(FileNotFoundError), open(state if verb == "show" else decision) as handle:
            sys.stdout.write(handle.read())
    elif verb == "clear" and value is None:
        for name in (state, decision):
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
    else:
        print(
            "usage: python -m runtime.front rollout set JSON | show | decide promote|abort | decision | clear",
            file=sys.stderr,
        )
        return 2
    return 0


def _written(write: Callable[..., None], *args: str) -> int:
    """A command that writes one of the front's files: 0, or 2 with what was wrong with its arguments."""
    try:
        write(*args)
    except ValueError as exc:
        print(f"front: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = os.environ.get(TARGET_FILE_ENV, DEFAULT_TARGET_FILE)
    shadow_path = os.environ.get(SHADOW_FILE_ENV, DEFAULT_SHADOW_FILE)
    if argv[:1] == ["shadow"] and len(argv) == 2 and argv[1] == "off":
        with contextlib.suppress(FileNotFoundError):
            os.remove(shadow_path)
        return 0
    if argv[:1] == ["shadow"] and 3 <= len(argv) <= 5:
        return _written(write_shadow, shadow_path, *argv[1:])
    if argv[:1] == ["rollout"] and len(argv) in (2, 3):
        return rollout_command(os.path.dirname(path) or ".", argv[1:])
    if argv == ["stats"]:
        with contextlib.suppress(FileNotFoundError), open(f"{shadow_path}{STATS_SUFFIX}") as handle:
            sys.stdout.write(handle.read())
        return 0
    if argv[:1] == ["set"] and len(argv) >= 2:
        return _written(write_target, path, *argv[1:])
    if argv:
        print(
            "usage: python -m runtime.front [set HOST:PORT[=WEIGHT] ... | shadow URL SHARE [RTOL [ATOL]] | shadow off"
            " | stats | rollout ...]",
            file=sys.stderr,
        )
        return 2
    try:
        front = Front(
            Target(path, os.environ.get(TARGET_ENV)),
            float(os.environ.get(CONNECT_TIMEOUT_ENV, "10")),
            ShadowTarget(shadow_path),
        )
        port = int(os.environ.get(PORT_ENV, DEFAULT_PORT))
        drain = float(os.environ.get(DRAIN_ENV, "5"))
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    asyncio.run(serve(port, front, drain))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
