"""Inference server for any MLflow pyfunc model: a minimal ASGI app on uvicorn (uvloop + httptools, one worker).

Run it as ``python -m runtime.serve`` (or ``python runtime/serve.py``). Settings come from the environment (the
names in ``runtime/contract.py`` plus a few of this server's own):

``MODEL_URI``          A path, ``file:///path`` or ``s3://bucket/prefix`` of a stored checkpoint: an MLflow model
                       directory (``MLmodel`` and its flavour's files, any flavour) plus ``MANIFEST.json``. Required.
                       Every file the manifest lists is fetched into a private directory and checked (size and
                       sha256) before the model loads; a checkpoint without a manifest, or with a file that does
                       not match, is refused: the server exits 1 without becoming ready. ``s3://`` uses boto3
                       (``AWS_ENDPOINT_URL``, ``AWS_CA_BUNDLE`` and the usual credential variables).
``MODEL_SHA256``       The sha256 of the checkpoint's manifest as the model version records it (gpuferry's serving
                       backends set it): a checkpoint whose manifest has another is refused before anything is
                       fetched, and the server exits 1 (the stored checkpoint was replaced since it was registered).
``MODEL_NAME``         What ``/readyz`` calls the model (the MLmodel's ``artifact_path``, else ``model``).
``HOST``, ``PORT``     Where to listen (127.0.0.1:8080).
``MODEL_DEVICE``       Where the model runs: ``auto`` (default: ``cuda`` when torch is importable, sees a GPU and
                       ``CUDA_VISIBLE_DEVICES`` is not empty; else ``cpu``), ``cpu``, ``cuda`` (the first visible
                       GPU) or ``cuda:N``. gpuferry's backends set it: ``cuda`` for a service given GPUs, ``cpu`` and
                       ``CUDA_VISIBLE_DEVICES=""`` for one without (the ``cpu`` path never initialises CUDA). An
                       ``mlflow.pytorch`` model is loaded there by the server (a ``torch.export`` model saved on
                       another device is moved; a pickled or TorchScript one is mapped); other flavours load where
                       MLflow puts them (``runtime.device``). A model that cannot go there (``cuda`` and torch sees
                       no GPU, a move that fails) is not served: the server logs why and what to do, and exits 1.
``MAX_BATCH_SIZE``     Rows per predict call (64). A single request larger than this runs as a batch of its own;
                       1 turns batching off.
``MAX_BATCH_WAIT_MS``  The longest the oldest queued request waits for its batch to fill (2). The batch leaves
                       earlier once the server has read every request in reach (``runtime.batching.Batcher``).
``MAX_QUEUE``          Requests that may wait for a predict call (256); past it ``/invocations`` answers 503 with
                       ``Retry-After`` instead of growing latency without bound.
``MAX_REQUEST_ROWS``   Rows one request may carry (1024); more is a 422.
``MAX_REQUEST_BYTES``  The largest body (64 MiB); more is a 413.
``DRAIN_SECONDS``      After SIGTERM, how long the server keeps serving while ``/readyz`` already says 503 (2).
``WARMUP_ITERATIONS``  Times the model's own serving input example (saved with ``input_example``) is scored, alone
                       and as a full batch, before ``/readyz`` says ready (3, at least 1). A model whose example
                       fails is not served.
``TORCH_NUM_THREADS``  For models that load torch, its intra-op threads (default: the usable cores, counting a
                       container's CPU limit, minus one left for request handling; ``OMP_NUM_THREADS`` wins).

Endpoints:

``POST /invocations``  MLflow's scoring protocol (``runtime.scoring``): JSON with exactly one of
                       ``dataframe_split``, ``dataframe_records``, ``instances``, ``inputs`` and optional
                       ``params``, or ``text/csv`` → ``{"predictions": ...}`` as ``mlflow models serve`` answers.
                       422 names the column, element or shape that does not match the signature; 400 for a body
                       that is not the protocol; 415 for other media types; 413 past ``MAX_REQUEST_BYTES``; 503
                       with ``Retry-After`` while not loaded or when the queue is full. Errors are MLflow's body:
                       ``{"error_code": ..., "message": ...}``.
``GET /ping``, ``/health``  MLflow's health check: 200 once ready, 503 before and while draining.
``GET /healthz``       Liveness: 200 as soon as the process listens.
``GET /readyz``        Readiness: 200 once the model is loaded and warmed up, 503 before that and while draining.
                       The body names the model, its flavours, signature and checkpoint (manifest) sha256 and the
                       state, ``device`` (where the model runs: ``cpu``, ``cuda:0``, ...; null until loaded) and
                       the settings (``model_device``: what ``MODEL_DEVICE`` asked); never where it is stored.
                       ``GET /`` answers the same body with 200.
``GET /version``       The MLflow version serving the model, as ``mlflow models serve`` answers it (the body is
                       the bare version); once loaded, an ``X-Model-Device`` header says where the model runs.
``GET /metrics``       Prometheus text: requests by status code, latency, rows and requests per predict call,
                       predict time, fallbacks, queue depth, readiness; with a shadow, what ``runtime.shadow``
                       measures (its answers by code, their latency, the rows that agree and those that do not).

Shadow traffic: with ``SHADOW_URL`` set (and the other ``SHADOW_*`` settings of ``runtime/shadow.py``), a copy of a
share of the requests goes to another version once this server has answered; clients get this server's answers only.
``ROUTE_FILE`` (``runtime/route.py``) sets a canary (another version answers a share of the requests) or a shadow
while the server runs: the file is read again when it changes.

Concurrent requests are queued and predicted together on one dedicated thread, never on the event loop, so the
probes answer while the model works. On SIGTERM (or Ctrl+C) readiness turns false at once, requests keep being
served for ``DRAIN_SECONDS`` (each answer with ``Connection: close``, so that keep-alive clients move to another
replica), then the listener closes, in-flight requests finish and the process exits 0. A second signal skips the
rest of the drain window.
"""

from __future__ import annotations

import sys

# Run as a script (python /opt/gpuferry/runtime/serve.py, as every backend starts it): gpuferry's root first, so
# that a workload's own `runtime.py` cannot shadow this package, and the working directory (the workload's, in its
# image) last, so that a model's own modules still import.
if __package__ in (None, ""):
    import os
    import os.path

    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(os.getcwd())

import asyncio
import gc
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from runtime.batching import Batcher, Overloaded
from runtime.device import DeviceError, moved_fix
from runtime.jsonio import dumps, error_body
from runtime.loading import LoadedModel, load
from runtime.metrics import Metrics
from runtime.route import Route
from runtime.settings import Settings

log = logging.getLogger("runtime.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RETRY_AFTER_SECONDS = 1


# ------------------------------------------------------------------------------------------------------- app

_JSON = b"application/json"
_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
_RETRY_AFTER = ((b"retry-after", str(RETRY_AFTER_SECONDS).encode()),)


def _error(status: int, message: str, code: str) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]:
    return status, error_body(message, code), _RETRY_AFTER if status == 503 else ()


class _NotLoaded(Exception):
    """Stands for runtime.scoring.RequestError until the model is loaded."""


class InferenceApp:
    """The ASGI application: routes, model lifecycle (fetch, verify, load, warm up, drain) and the batcher."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.phase = "loading"  # → warming-up → loaded, or → failed
        self.draining = False  # set by SIGTERM; kept apart from phase so the signal handler only assigns a flag
        self.model: LoadedModel | None = None
        self.scorer: Any = None  # set once warmed up: /invocations serves only then
        self.batcher: Batcher[Any, bytes] = Batcher(
            self._predict_many,
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_batch_wait_ms / 1000,
            max_queue=settings.max_queue,
            observe=self.metrics.observe_batch,
        )
        self._parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")
        self._scratch = Path(tempfile.mkdtemp(prefix="gpuferry-model-"))
        self._tasks: list[asyncio.Task[None]] = []
        # runtime.scoring imports MLflow, which load() imports on the predict thread (two threads importing it
        # at once fail on its circular imports): the event loop reaches it only once the model is loaded.
        self._request_error: type[Exception] = _NotLoaded
        self.route = Route(settings.route_file, settings.shadow)  # a canary's or shadow's share of the requests

    @property
    def ready(self) -> bool:
        return self.phase == "loaded" and not self.draining

    @property
    def failed(self) -> bool:
        return self.phase == "failed"

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        return "ready" if self.phase == "loaded" else self.phase

    def _predict_many(self, items: list[Any]) -> list[Any]:
        assert self.model is not None
        return self.model.scorer.predict_many(items)  # a RequestError in it is raised to its caller alone

    # --- lifecycle

    async def _startup(self) -> None:
        self.batcher.start()
        self._tasks.append(asyncio.create_task(self._load()))

    async def _load(self) -> None:
        started = time.monotonic()
        try:
            # On the predict thread: per-thread state some frameworks keep (CUDA contexts, ...) is made there.
            self.model = await self.batcher.call(load, self.settings, self._scratch)
            self.phase = "warming-up"
            await self._warm_up(self.model)
        except Exception as exc:  # every cause means the same: not served
            trace = None if isinstance(exc, DeviceError) else exc  # its message says all there is to do
            log.error("could not load the model from %s: %s", self.settings.model_uri, exc, exc_info=trace)
            self.phase = "failed"
            return
        from runtime.scoring import RequestError  # imported by load() already: mlflow is in

        self._request_error = RequestError
        # The frameworks' modules and the model are millions of objects that live as long as the process: out of
        # the collector's sight, a full collection no longer stalls every request for a tenth of a second.
        gc.collect()
        gc.freeze()
        self.scorer = self.model.scorer
        self.phase = "loaded"
        d = self.model.description
        log.info(
            "model ready in %.1f s: %s (%s) on %s, checkpoint_sha256=%s",
            time.monotonic() - started,
            d["name"],
            d["loader_module"],
            self.model.device,
            d["checkpoint_sha256"],
        )

    async def _warm_up(self, model: LoadedModel) -> None:
        """Score the model's own serving input example, alone and as a full batch, as requests would be."""
        example = model.serving_input
        if example is None:
            log.info("the model has no serving input example: no warm-up (log it with input_example=...)")
            return
        scorer = model.scorer
        body = example.encode()
        loop = asyncio.get_running_loop()
        scoring = scorer.parse(body, "application/json")
        if scoring is None:
            scoring = await loop.run_in_executor(self._parse_pool, scorer.parse_slow, body, "application/json")
        copies = max(1, self.settings.max_batch_size // max(1, scoring.rows))
        for _ in range(self.settings.warmup_iterations):
            for batch in ([scoring], [scoring] * copies):
                for answer in await self.batcher.call(scorer.predict_many, batch):
                    if not isinstance(answer, bytes):
                        raise RuntimeError(
                            f"the model's own serving input example fails: {answer.message}"
                            f"{moved_fix(model.how, model.device)}"
                        )

    async def _shutdown(self) -> None:
        # uvicorn calls this after every in-flight request has finished, so nothing is queued any more.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.batcher.close()
        await self.route.close()
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._scratch, ignore_errors=True)

    # --- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, _closing(send) if self.draining else send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/invocations":
            if method != "POST":
                await _respond(send, *_error(405, "use POST", "BAD_REQUEST"), allow=b"POST")
                return
            started = time.perf_counter()
            request = _Request(scope)
            self.route.refresh()
            canary = self.route.canary
            if canary is not None and self.scorer is not None and canary.take():
                request.read = True
                request.body = await _read_body(receive, self.settings.max_request_bytes)
                answered = await canary.send(request.body, request.content_type) if request.body else None
                if answered is not None:  # the canary's answer (its own metrics count it); else answered here
                    status, body, kind = answered
                    await _respond(send, status, body, content_type=kind.encode() if kind else _JSON)
                    return
            status, body, headers = await self._invocations(request, receive)
            # Counted before the response goes out, so a client never sees a response the metrics miss.
            self.metrics.observe_request(status, time.perf_counter() - started)
            await _respond(send, status, body, headers)
            shadow = self.route.shadow
            if shadow is not None and request.body is not None:  # after the answer: a copy never delays it
                shadow.offer(request.body, request.content_type, status, body)
            return
        if method != "GET":
            await _respond(send, *_error(405, "use GET", "BAD_REQUEST"), allow=b"GET")
        elif path == "/healthz":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path in ("/ping", "/health"):
            await _respond(send, 200 if self.ready else 503, b"\n")
        elif path in ("/readyz", "/"):
            await _respond(send, 200 if self.ready or path == "/" else 503, dumps(self.describe()))
        elif path == "/version":
            device = ((b"x-model-device", self.model.device.encode()),) if self.model is not None else ()
            await _respond(send, 200, self._mlflow_version().encode(), device)
        elif path == "/metrics":
            fallbacks = self.scorer.fallbacks if self.scorer is not None else 0
            self.metrics.fallbacks = fallbacks
            self.route.refresh(force=True)
            extra = self.route.render() + (self.route.shadow.render() if self.route.shadow is not None else [])
            await _respond(send, 200, self.metrics.render(self.batcher.depth, self.ready, extra), content_type=_TEXT)
        else:
            await _respond(send, *_error(404, f"no route {path}", "ENDPOINT_NOT_FOUND"))

    def describe(self) -> dict[str, Any]:
        """The /readyz body: the state and the model, never where the model is stored."""
        s = self.settings
        return {
            "ready": self.ready,
            "state": self.state,
            "model": self.model.description if self.model is not None else None,
            "device": self.model.device if self.model is not None else None,
            "settings": {
                "model_device": s.model_device,
                "max_batch_size": s.max_batch_size,
                "max_batch_wait_ms": s.max_batch_wait_ms,
                "max_queue": s.max_queue,
                "max_request_rows": s.max_request_rows,
                "max_request_bytes": s.max_request_bytes,
            },
        }

    def _mlflow_version(self) -> str:
        if self.model is not None:
            return str(self.model.description["served_with_mlflow"])
        from importlib.metadata import version

        return version("mlflow-skinny") if _installed("mlflow-skinny") else version("mlflow")

    async def _invocations(
        self, request: _Request, receive: Receive
    ) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]:
        scorer = self.scorer
        if scorer is None:
            return _error(503, f"the model is not ready ({self.state})", "TEMPORARILY_UNAVAILABLE")
        content_type = request.content_type
        limit = self.settings.max_request_bytes
        if request.length is not None and request.length > limit:
            return _error(413, f"the body exceeds {limit} bytes (MAX_REQUEST_BYTES)", "BAD_REQUEST")
        body = request.body if request.read else await _read_body(receive, limit)
        request.body = body
        if body is None:
            return _error(413, f"the body exceeds {limit} bytes (MAX_REQUEST_BYTES)", "BAD_REQUEST")
        if self.batcher.full:  # refuse before spending time on parsing
            return _error(503, "overloaded: the request queue is full", "TEMPORARILY_UNAVAILABLE")
        try:
            scoring = scorer.parse(body, content_type)
            if scoring is None:
                loop = asyncio.get_running_loop()
                scoring = await loop.run_in_executor(self._parse_pool, scorer.parse_slow, body, content_type)
            answer = await self.batcher.submit(scoring, scoring.rows, scoring.key)
        except self._request_error as exc:
            error: Any = exc  # runtime.scoring.RequestError once the model is loaded (it imports MLflow)
            return error.status, error.body(), ()
        except Overloaded:
            return _error(503, "overloaded: the request queue is full", "TEMPORARILY_UNAVAILABLE")
        except Exception:  # logged where it happened
            log.exception("scoring failed")
            return _error(500, "inference failed", "INTERNAL_ERROR")
        return 200, answer, ()


class _Request:
    """An /invocations request: its media type and length from the headers, its body once read."""

    def __init__(self, scope: Scope) -> None:
        self.content_type: str | None = None
        self.length: int | None = None
        self.body: bytes | None = None
        self.read = False  # the body was read already (a canary's request answered here after all)
        for name, value in scope["headers"]:
            if name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"content-length" and value.isdigit():
                self.length = int(value)


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit`` bytes."""
    message = await receive()
    body = message.get("body", b"")
    if len(body) > limit:
        return None
    if not message.get("more_body", False):
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _closing(send: Send) -> Send:
    """``send`` adding ``connection: close`` to the response: while the server drains, a keep-alive client
    leaves after this answer (and reconnects to another replica) instead of racing the listener's close."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing_send


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = _JSON,
    allow: bytes | None = None,
) -> None:
    extra = [*headers, (b"allow", allow)] if allow is not None else headers
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------------------- server


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain window: the first SIGTERM/SIGINT makes readiness false and only after
    ``drain_seconds`` closes the listener (uvicorn then waits for in-flight requests). A second signal ends the
    window at once; a third stops without waiting. The process exits 0 (uvicorn would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, app: InferenceApp, drain_seconds: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_seconds = drain_seconds
        self._drain_deadline: float | None = None
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: only plain assignments here; on_tick does the rest on the event loop.
        if self._drain_deadline is None:
            self._app.draining = True
            self._drain_deadline = time.monotonic() + self._drain_seconds
        elif not self.should_exit:
            self.should_exit = True
        else:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None:
            if not self._drain_logged:
                self._drain_logged = True
                log.info(
                    "draining: not ready; serving for %.1f s more, then finishing in-flight requests",
                    self._drain_seconds,
                )
            if time.monotonic() >= self._drain_deadline:
                self.should_exit = True
        if self._app.failed:
            self.should_exit = True
        return await super().on_tick(counter)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    app = InferenceApp(settings)
    log.info(
        "serving %s on http://%s:%d: model_device=%s max_batch_size=%d max_batch_wait_ms=%g max_queue=%d "
        "max_request_rows=%d drain_seconds=%g warmup_iterations=%d",
        settings.model_uri,
        settings.host,
        settings.port,
        settings.model_device,
        settings.max_batch_size,
        settings.max_batch_wait_ms,
        settings.max_queue,
        settings.max_request_rows,
        settings.drain_seconds,
        settings.warmup_iterations,
    )
    if settings.shadow is not None:
        log.info("copying %g of the requests to the shadow %s", settings.shadow.share, settings.shadow.url)
    if settings.route_file is not None:
        log.info("a canary or shadow is read from %s (ROUTE_FILE) when it changes", settings.route_file)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop" if _installed("uvloop") else "asyncio",
        http="httptools" if _installed("httptools") else "h11",
        ws="none",
        lifespan="on",
        workers=1,
        access_log=False,
        log_config=None,
        log_level="info",
    )
    server = DrainingServer(config, app, settings.drain_seconds)
    try:
        server.run()
    finally:
        shutil.rmtree(app._scratch, ignore_errors=True)
    sys.exit(1 if app.failed else 0)


if __name__ == "__main__":
    main()
