"""Inference server for the example model: a minimal ASGI app on uvicorn (uvloop + httptools, one worker).

Run it as ``python -m workload.serve`` or ``python workload/serve.py``. Settings come from the environment
(the names in ``workload/contract.py`` plus a few of this server's own):

``MODEL_URI``          ``file://`` URI or plain path of a checkpoint directory holding ``model.pt``, or of the
                       ``model.pt`` itself; or ``s3://bucket/key`` of either (boto3, which honours
                       ``AWS_ENDPOINT_URL`` and the usual credential variables). Required. The checkpoint
                       directory must hold ``MANIFEST.json`` (``workload/contract.py``): every file it lists is
                       checked (size and sha256) before the model loads, and a checkpoint without one, or with a
                       file that does not match, is refused: the server exits 1 without becoming ready.
``HOST``, ``PORT``     Where to listen (127.0.0.1:8080).
``MAX_BATCH_SIZE``     Rows per forward pass (64). A single request larger than this runs as a batch of its own.
``MAX_BATCH_WAIT_MS``  The longest the oldest queued request waits for its batch to fill (2). The batch leaves
                       earlier once the server has read every request in reach (see ``Batcher``).
``MAX_QUEUE``          Requests that may wait for a forward pass (256); past it ``/predict`` answers 503 with
                       ``Retry-After`` instead of growing latency without bound.
``MAX_REQUEST_ROWS``   Rows one request may carry (1024); more is a 422.
``DRAIN_SECONDS``      After SIGTERM, how long the server keeps serving while ``/readyz`` already says 503 (2).
``WARMUP_ITERATIONS``  Forward passes at batch sizes 1 and ``MAX_BATCH_SIZE`` before ``/readyz`` says ready (3, at
                       least 1).
``DEVICE``             ``cpu`` or ``cuda[:N]`` (the GPU when one is present, else the CPU).
``TORCH_NUM_THREADS``  torch intra-op threads (on a GPU 1; on a CPU the usable cores, counting a container's CPU
                       limit, minus one that stays free for request handling).

Endpoints:

``POST /predict``  ``{"inputs": [[64 numbers], ...]}``, always a list of rows (a single sample is
                   ``[[...]]``), → ``{"predictions": [int, ...], "probabilities": [[10 floats], ...]}``.
                   422 names what is wrong with the input; 503 with ``Retry-After`` while the model is not ready
                   or the queue is full; 413 for a body far larger than ``MAX_REQUEST_ROWS`` rows can need.
``GET /healthz``   200 as soon as the process listens.
``GET /readyz``    200 once the model is loaded and warmed up, 503 before that and while draining; the JSON
                   body carries the state and the model's URI, file hash, checkpoint (manifest) hash and config
                   (``GET /`` returns the same).
``GET /metrics``   Prometheus text: requests by status code, request latency, rows per forward pass, queue depth.

Concurrent requests are queued and run through the model together; each caller gets its own rows back. On
SIGTERM (or Ctrl+C) readiness turns false at once, requests keep being served for ``DRAIN_SECONDS`` (each answer
with ``Connection: close``, so that keep-alive clients move to another replica), then the listener closes, in-flight requests finish and the process exits 0. A second signal skips the rest of the drain
window.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import torch
import uvicorn
from torch import nn

try:
    from workload import contract
    from workload.model import N_FEATURES, load_model_file
except ImportError:  # run as a script (python workload/serve.py): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from workload import contract
    from workload.model import N_FEATURES, load_model_file

try:  # orjson parses and writes JSON several times faster; the standard library is the fallback
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    _dumps: Callable[[Any], bytes] = orjson.dumps
    _JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:

    def _reject_constant(name: str) -> float:
        raise ValueError(f"{name} is not valid JSON")

    def _loads(data: bytes) -> Any:
        return json.loads(data, parse_constant=_reject_constant)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _JSONDecodeError = ValueError

log = logging.getLogger("workload.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Generous upper bound on the bytes one JSON number needs ("-0.12345678901234567e-300,"): bodies beyond
# MAX_REQUEST_ROWS rows of these are refused before they are read in full.
_MAX_BYTES_PER_VALUE = 32
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NUMBER_TYPES = frozenset({int, float})
RETRY_AFTER_SECONDS = 1


# --------------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """The server's configuration, read once from the environment."""

    model_uri: str
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch_size: int = 64
    max_batch_wait_ms: float = 2.0
    max_queue: int = 256
    max_request_rows: int = 1024
    drain_seconds: float = 2.0
    warmup_iterations: int = 3
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    torch_threads: int | None = None  # None: chosen by torch_threads_for

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        model_uri = env.get(contract.MODEL_URI, "")
        if not model_uri:
            raise ValueError(f"{contract.MODEL_URI} is not set")

        def number(name: str, default: float | None, kind: type[int] | type[float], minimum: float) -> Any:
            raw = env.get(name, "")
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
            if value < minimum:
                raise ValueError(f"{name}={raw!r} must be at least {minimum}")
            return value

        return cls(
            model_uri=model_uri,
            host=env.get(contract.HOST, "") or cls.host,
            port=number(contract.PORT, cls.port, int, 0),
            max_batch_size=number(contract.MAX_BATCH_SIZE, cls.max_batch_size, int, 1),
            max_batch_wait_ms=number(contract.MAX_BATCH_WAIT_MS, cls.max_batch_wait_ms, float, 0),
            max_queue=number(contract.MAX_QUEUE, cls.max_queue, int, 1),
            max_request_rows=number("MAX_REQUEST_ROWS", cls.max_request_rows, int, 1),
            drain_seconds=number("DRAIN_SECONDS", cls.drain_seconds, float, 0),
            warmup_iterations=number("WARMUP_ITERATIONS", cls.warmup_iterations, int, 1),
            torch_threads=number("TORCH_NUM_THREADS", None, int, 1),
            **({"device": env["DEVICE"]} if env.get("DEVICE") else {}),
        )


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a container's CPU limit)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def torch_threads_for(device: torch.device, requested: int | None) -> int:
    """Intra-op threads: on a GPU the CPU only launches kernels; on a CPU one core stays free for request handling
    (torch's own default counts the host's cores, ignoring a container's limit, and oversubscribes)."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        return 1
    return max(1, usable_cpus() - 1)


# ------------------------------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class ModelInfo:
    uri: str
    sha256: str  # of model.pt
    checkpoint_sha256: str  # of the checkpoint's MANIFEST.json: its identity, as recorded in MLflow
    config: dict[str, Any]
    device: str

    def as_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "sha256": self.sha256,
            "checkpoint_sha256": self.checkpoint_sha256,
            "config": self.config,
            "device": self.device,
        }


class UnverifiedCheckpoint(Exception):
    """The checkpoint has no manifest, or a file that does not match it: it is not served."""


@dataclass(frozen=True)
class VerifiedModel:
    data: bytes  # model.pt's bytes, checked against the manifest (loaded from memory: no second read to race)
    sha256: str
    checkpoint_sha256: str


def fetch_model(uri: str, scratch: Path) -> VerifiedModel:
    """The model that ``uri`` names, with every file of its checkpoint checked against the checkpoint's manifest.

    ``s3://`` checkpoints are downloaded into ``scratch`` (one streamed GET per file, hashed on the way).
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        key = parsed.path.strip("/")
        root, _, name = key.rpartition("/") if key.endswith(contract.MODEL_FILENAME) else (key, "", "")
        return _fetch_s3(parsed.netloc, root, name or contract.MODEL_FILENAME, scratch)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: file:// URIs must name a local path (file:///path)")
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(uri)
    else:
        raise ValueError(f"{uri}: unsupported scheme {parsed.scheme!r} (use file://, s3:// or a path)")
    root, name = (path, contract.MODEL_FILENAME) if path.is_dir() else (path.parent, path.name)
    if not (root / name).is_file():
        raise FileNotFoundError(f"{uri}: no model file at {root / name}")
    try:
        raw = (root / contract.MANIFEST_FILENAME).read_bytes()
    except FileNotFoundError:
        raise UnverifiedCheckpoint(_no_manifest(root)) from None
    files = _manifest_files(raw, str(root), name)
    for entry in files:
        if entry["path"] != name:
            _check_file(entry, root / entry["path"], f"{root}/{entry['path']}")
    data = (root / name).read_bytes()
    _check(_entry(files, name), len(data), hashlib.sha256(data).hexdigest(), f"{root}/{name}")
    return VerifiedModel(data, _entry(files, name)["sha256"], hashlib.sha256(raw).hexdigest())


def _fetch_s3(bucket: str, root: str, name: str, scratch: Path) -> VerifiedModel:
    import boto3  # only s3:// URIs need it

    # boto3 reads AWS_ENDPOINT_URL itself from 1.28 on; passing it keeps older releases on the same endpoint.
    client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
    prefix = f"{root}/" if root else ""
    where = f"s3://{bucket}/{root}"
    try:
        raw = client.get_object(Bucket=bucket, Key=f"{prefix}{contract.MANIFEST_FILENAME}")["Body"].read()
    except client.exceptions.NoSuchKey:
        raise UnverifiedCheckpoint(_no_manifest(where)) from None
    files = _manifest_files(raw, where, name)
    for entry in files:
        where = f"s3://{bucket}/{prefix}{entry['path']}"
        target = scratch / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        try:  # one plain GET per file, hashed as it streams (ranged GETs are slow on some S3-compatible servers)
            body = client.get_object(Bucket=bucket, Key=f"{prefix}{entry['path']}")["Body"]
        except client.exceptions.NoSuchKey:
            raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
        with open(target, "wb") as out:
            for chunk in body.iter_chunks(1 << 20):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        _check(entry, size, digest.hexdigest(), where)
    return VerifiedModel((scratch / name).read_bytes(), _entry(files, name)["sha256"], hashlib.sha256(raw).hexdigest())


def _no_manifest(where: object) -> str:
    return (
        f"{where} has no {contract.MANIFEST_FILENAME}: refusing to serve a checkpoint that cannot be verified "
        "(store it with a gpuferry checkpoint store, which writes the manifest last)"
    )


def _manifest_files(raw: bytes, where: str, model_name: str) -> list[dict[str, Any]]:
    files = contract.parse_manifest(raw, where)["files"]
    if not any(entry["path"] == model_name for entry in files):
        raise UnverifiedCheckpoint(f"{where}/{contract.MANIFEST_FILENAME} does not list {model_name}")
    return files


def _entry(files: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(entry for entry in files if entry["path"] == name)


def _check_file(entry: dict[str, Any], path: Path, where: str) -> None:
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = f.tell()
    except FileNotFoundError:
        raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
    _check(entry, size, digest, where)


def _check(entry: dict[str, Any], size: int, sha256: str, where: str) -> None:
    if size != entry["size"] or sha256 != entry["sha256"]:
        raise UnverifiedCheckpoint(
            f"{where}: sha256 {sha256} ({size} bytes) but {contract.MANIFEST_FILENAME} says {entry['sha256']} "
            f"({entry['size']} bytes): the checkpoint is corrupt or incomplete; refusing to serve it"
        )


def load_model(uri: str, device: torch.device) -> tuple[nn.Module, ModelInfo]:
    """Fetch, verify and load the checkpoint onto ``device``, in eval mode."""
    with tempfile.TemporaryDirectory(prefix="serve-model-") as scratch:
        verified = fetch_model(uri, Path(scratch))
    model, config = load_model_file(io.BytesIO(verified.data), map_location="cpu")
    model.to(device).requires_grad_(False)
    info = ModelInfo(uri, verified.sha256, verified.checkpoint_sha256, config, str(device))
    return model, info


class Predictor:
    """Runs one batch through the model (without autograd) and returns plain lists."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self._model = model
        self._device = device

    def __call__(self, x: np.ndarray) -> tuple[list[int], list[list[float]]]:
        with torch.inference_mode():
            inputs = torch.from_numpy(x).to(self._device)
            probabilities = torch.softmax(self._model(inputs), dim=1).cpu()
            # One device-to-host copy and one conversion per batch; each caller slices its rows from the lists.
            return probabilities.argmax(dim=1).tolist(), probabilities.tolist()

    def warm_up(self, batch_sizes: tuple[int, ...], iterations: int) -> None:
        for _ in range(iterations):
            for rows in batch_sizes:
                self(np.zeros((rows, N_FEATURES), dtype=np.float32))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


# ------------------------------------------------------------------------------------------------------ input


class InputError(ValueError):
    """The request body is not a valid batch; the message names the problem (→ 422)."""


def parse_inputs(payload: Any, max_rows: int) -> np.ndarray:
    """Validate ``{"inputs": [[64 numbers], ...]}`` and return it as a float32 array of shape (rows, 64)."""
    if type(payload) is not dict or "inputs" not in payload:
        raise InputError('the body must be a JSON object with an "inputs" key: {"inputs": [[64 numbers], ...]}')
    rows = payload["inputs"]
    if type(rows) is not list or not rows:
        raise InputError(f'"inputs" must be a non-empty list of rows of {N_FEATURES} numbers, got {_describe(rows)}')
    if len(rows) > max_rows:
        raise InputError(f'"inputs" has {len(rows)} rows; at most {max_rows} (MAX_REQUEST_ROWS) per request')
    # The checks below run in C (set/map) on the happy path; the loops that name the culprit run only on errors.
    if set(map(type, rows)) != {list}:
        i, row = next((i, r) for i, r in enumerate(rows) if type(r) is not list)
        flat = i == 0 and len(rows) == N_FEATURES
        hint = ' (a single sample is a list of one row: {"inputs": [[...]]})' if flat else ""
        raise InputError(f'"inputs[{i}]" must be a list of {N_FEATURES} numbers, got {_describe(row)}{hint}')
    if set(map(len, rows)) != {N_FEATURES}:
        i, row = next((i, r) for i, r in enumerate(rows) if len(r) != N_FEATURES)
        raise InputError(f'"inputs[{i}]" has {len(row)} values; expected {N_FEATURES}')
    if not set(map(type, chain.from_iterable(rows))) <= _NUMBER_TYPES:
        i, j, value = next(
            (i, j, v) for i, r in enumerate(rows) for j, v in enumerate(r) if type(v) not in _NUMBER_TYPES
        )
        raise InputError(f'"inputs[{i}][{j}]" must be a number, got {_describe(value)}')
    x = np.array(rows, dtype=np.float32)
    if not np.isfinite(x).all():  # finite in JSON yet beyond float32's range (e.g. 1e39, 2**200)
        i, j = (int(k[0]) for k in np.nonzero(~np.isfinite(x)))
        raise InputError(f'"inputs[{i}][{j}]" = {rows[i][j]!r} is out of range (|x| <= {_FLOAT32_MAX:.4g})')
    return x


def _describe(value: Any) -> str:
    """What a JSON value is, for error messages: 'a string ("abc")', 'null', 'an object'."""
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"{kind} ({_dumps(value).decode()[:40]})" if type(value) in (str, bool, int, float) else kind


# -------------------------------------------------------------------------------------------------- metrics


class Histogram:
    """A Prometheus histogram: cumulative buckets rendered from per-bucket counts."""

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i counts values <= bounds[i]
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.9g}", f"{self.name}_count {total}"]
        return lines


class Metrics:
    """The server's metrics; updated on the event loop thread only, so no locks."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}
        self.latency = Histogram(
            "inference_request_duration_seconds",
            "Time from the start of a /predict request until its response is ready to send.",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.batch_size = Histogram(
            "inference_batch_size",
            "Rows per forward pass.",
            (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )

    def observe_request(self, status: int, seconds: float) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        self.latency.observe(seconds)

    def render(self, queue_depth: int, ready: bool) -> bytes:
        lines = [
            "# HELP inference_requests_total /predict requests by HTTP status code.",
            "# TYPE inference_requests_total counter",
            *(f'inference_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())),
            *self.latency.render(),
            *self.batch_size.render(),
            "# HELP inference_queue_depth Requests waiting for a forward pass.",
            "# TYPE inference_queue_depth gauge",
            f"inference_queue_depth {queue_depth}",
            "# HELP inference_ready 1 when the server reports ready.",
            "# TYPE inference_ready gauge",
            f"inference_ready {int(ready)}",
        ]
        return ("\n".join(lines) + "\n").encode()


# -------------------------------------------------------------------------------------------------- batching


class Overloaded(Exception):
    """The queue is full (→ 503 with Retry-After)."""


@dataclass(slots=True)
class _Pending:
    x: np.ndarray
    future: asyncio.Future[tuple[list[int], list[list[float]]]]
    arrived: float


class Batcher:
    """Gathers queued requests into forward passes of up to ``max_rows`` rows.

    A batch goes to the model when it holds ``max_rows`` rows, when its oldest request has waited ``max_wait``
    seconds, or as soon as the event loop goes quiet (two turns without a new request). A quiet loop means every
    request the server has read is queued already: waiting longer would add latency and gather nothing. So a lone
    request is not held back, while under load, when each turn of the loop brings new requests, batches grow up
    to either limit.

    The forward pass runs on the event loop thread. For this model it takes tens of microseconds, less than
    handing it to another thread costs (a wake-up plus GIL hand-offs, measured slower here).
    """

    def __init__(self, predictor: Predictor, metrics: Metrics, max_rows: int, max_wait: float, max_queue: int) -> None:
        self._predictor = predictor
        self._metrics = metrics
        self._max_rows = max_rows
        self._max_wait = max_wait
        self._max_queue = max_queue
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._arrivals = 0
        self._idle: asyncio.Future[None] | None = None

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self._max_queue

    async def submit(self, x: np.ndarray) -> tuple[list[int], list[list[float]]]:
        """Queue ``x`` and wait for its predictions and probabilities; raises Overloaded when the queue is full."""
        if self.full:
            raise Overloaded
        loop = asyncio.get_running_loop()
        pending = _Pending(x, loop.create_future(), loop.time())
        self._queue.append(pending)
        self._queued_rows += len(x)
        self._arrivals += 1
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return await pending.future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle = loop.create_future()
                await self._idle
                self._idle = None
            deadline = self._queue[0].arrived + self._max_wait
            while self._queued_rows < self._max_rows and loop.time() < deadline:
                arrivals = self._arrivals
                # A request read from a socket during one turn of the loop is parsed and queued by the end of
                # the next turn (its task runs only then), so the loop is quiet after two turns without one.
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                if self._arrivals == arrivals:
                    break
            self._execute(self._take())
            await asyncio.sleep(0)  # let the callers send their responses before the next batch

    def _take(self) -> list[_Pending]:
        """Pop whole requests, oldest first, up to ``max_rows`` rows (at least one request)."""
        batch = [self._queue.popleft()]
        rows = len(batch[0].x)
        while self._queue and rows + len(self._queue[0].x) <= self._max_rows:
            rows += len(self._queue[0].x)
            batch.append(self._queue.popleft())
        self._queued_rows -= rows
        return batch

    def _execute(self, batch: list[_Pending]) -> None:
        try:
            x = batch[0].x if len(batch) == 1 else np.concatenate([p.x for p in batch])
            self._metrics.batch_size.observe(len(x))
            predictions, probabilities = self._predictor(x)
        except Exception as exc:  # every caller of the batch gets the error (→ 500)
            log.exception("forward pass failed for a batch of %d requests", len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        start = 0
        for p in batch:
            end = start + len(p.x)
            if not p.future.done():  # done only if the caller went away
                p.future.set_result((predictions[start:end], probabilities[start:end]))
            start = end


# ------------------------------------------------------------------------------------------------------- app

_JSON = b"application/json"
_CONTENT_TYPE_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


class InferenceApp:
    """The ASGI application: routes, model lifecycle (load, warm up, drain) and the batcher."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = torch.device(settings.device)
        self.threads = torch_threads_for(self.device, settings.torch_threads)
        self.metrics = Metrics()
        self.phase = "loading"  # → warming-up → loaded, or → failed
        self.draining = False  # set by SIGTERM; kept apart from phase so the signal handler only assigns a flag
        self.model_info: ModelInfo | None = None
        self.batcher: Batcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._max_body = settings.max_request_rows * N_FEATURES * _MAX_BYTES_PER_VALUE + 4096

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

    # --- lifecycle

    async def _startup(self) -> None:
        torch.set_num_threads(self.threads)
        self._tasks.append(asyncio.create_task(self._load()))

    async def _load(self) -> None:
        try:
            started = time.monotonic()
            model, info = await asyncio.to_thread(load_model, self.settings.model_uri, self.device)
            predictor = Predictor(model, self.device)
            self.phase = "warming-up"
            sizes = tuple(sorted({1, self.settings.max_batch_size}))
            # All but the last warm-up pass run on a helper thread, so /healthz keeps answering meanwhile; the
            # last runs on the event loop thread, which runs every batch (per-thread state such as cuBLAS
            # handles is created there).
            await asyncio.to_thread(predictor.warm_up, sizes, self.settings.warmup_iterations - 1)
            predictor.warm_up(sizes, 1)
        except Exception:
            log.exception("could not load the model from %s", self.settings.model_uri)
            self.phase = "failed"
            return
        self.model_info = info
        self.batcher = Batcher(
            predictor,
            self.metrics,
            max_rows=self.settings.max_batch_size,
            max_wait=self.settings.max_batch_wait_ms / 1000,
            max_queue=self.settings.max_queue,
        )
        self._tasks.append(asyncio.create_task(self.batcher.run()))
        self.phase = "loaded"
        log.info(
            "model ready in %.1f s: sha256=%s checkpoint_sha256=%s config=%s device=%s",
            time.monotonic() - started,
            info.sha256,
            info.checkpoint_sha256,
            json.dumps(info.config),
            info.device,
        )

    async def _shutdown(self) -> None:
        # uvicorn calls this after every in-flight request has finished, so nothing is queued any more.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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
        if path == "/predict":
            if method != "POST":
                await _respond(send, 405, _error("use POST"), ((b"allow", b"POST"),))
                return
            started = time.perf_counter()
            status, body, headers = await self._predict(scope, receive)
            # Counted before the response goes out, so a client never sees a response the metrics miss.
            self.metrics.observe_request(status, time.perf_counter() - started)
            await _respond(send, status, body, headers)
            return
        if method != "GET":
            await _respond(send, 405, _error("use GET"), ((b"allow", b"GET"),))
        elif path == "/healthz":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path in ("/readyz", "/"):
            await _respond(send, 200 if self.ready or path == "/" else 503, _dumps(self._describe()))
        elif path == "/metrics":
            depth = self.batcher.depth if self.batcher is not None else 0
            body = self.metrics.render(depth, self.ready)
            await _respond(send, 200, body, content_type=_CONTENT_TYPE_TEXT)
        else:
            await _respond(send, 404, _error(f"no route {path}"))

    def _describe(self) -> dict[str, Any]:
        s = self.settings
        return {
            "ready": self.ready,
            "state": self.state,
            "model": self.model_info.as_json() if self.model_info is not None else {"uri": s.model_uri},
            "settings": {
                "max_batch_size": s.max_batch_size,
                "max_batch_wait_ms": s.max_batch_wait_ms,
                "max_queue": s.max_queue,
                "max_request_rows": s.max_request_rows,
                "torch_threads": self.threads,
            },
        }

    async def _predict(self, scope: Scope, receive: Receive) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]:
        batcher = self.batcher
        if batcher is None:
            return 503, _error(f"the model is not ready ({self.state})"), _RETRY_AFTER
        body = await _read_body(scope, receive, self._max_body)
        if body is None:
            return 413, _error(f"body exceeds {self._max_body} bytes"), ()
        if batcher.full:  # refuse before spending time on parsing
            return 503, _error("overloaded: the request queue is full"), _RETRY_AFTER
        try:
            x = parse_inputs(_loads(body), self.settings.max_request_rows)
        except InputError as exc:
            return 422, _error(str(exc)), ()
        except _JSONDecodeError as exc:
            return 422, _error(f"invalid JSON: {exc}"), ()
        try:
            predictions, probabilities = await batcher.submit(x)
        except Overloaded:
            return 503, _error("overloaded: the request queue is full"), _RETRY_AFTER
        except Exception:  # logged by the batcher
            return 500, _error("inference failed"), ()
        return 200, _dumps({"predictions": predictions, "probabilities": probabilities}), ()


_RETRY_AFTER = ((b"retry-after", str(RETRY_AFTER_SECONDS).encode()),)


def _error(message: str) -> bytes:
    return _dumps({"error": message})


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit`` bytes."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    message = await receive()
    body = message.get("body", b"")
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


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = _JSON,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _closing(send: Send) -> Send:
    """``send`` adding ``connection: close`` to the response: while the server drains, a keep-alive client
    leaves after this answer (and reconnects to another replica) instead of racing the listener's close."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing_send


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
    # Forward passes run one at a time: no inter-op parallelism. Set before any torch work starts.
    torch.set_num_interop_threads(1)
    log.info(
        "serving %s on http://%s:%d: device=%s torch_threads=%d max_batch_size=%d max_batch_wait_ms=%g "
        "max_queue=%d max_request_rows=%d drain_seconds=%g warmup_iterations=%d",
        settings.model_uri,
        settings.host,
        settings.port,
        app.device,
        app.threads,
        settings.max_batch_size,
        settings.max_batch_wait_ms,
        settings.max_queue,
        settings.max_request_rows,
        settings.drain_seconds,
        settings.warmup_iterations,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        workers=1,
        access_log=False,
        log_config=None,
        log_level="info",
    )
    server = DrainingServer(config, app, settings.drain_seconds)
    server.run()
    sys.exit(1 if app.failed else 0)


if __name__ == "__main__":
    main()
