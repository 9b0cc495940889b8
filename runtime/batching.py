"""Dynamic batching across concurrent requests, with the work on one dedicated thread (model-agnostic).

It imports only the standard library, so a workload's own server can use it::

    batcher = Batcher(predict_many, max_batch_size=64, max_wait_s=0.002, max_queue=256)
    batcher.start()                                   # inside the running event loop
    result = await batcher.submit(item, rows=len(item), key=params_key)   # Overloaded when the queue is full
    await batcher.close()

``predict_many(items)`` runs on the batcher's own thread, never on the event loop, so health probes and new
requests are answered while it works; it gets items that share one ``key`` (at most ``max_batch_size`` rows,
or a single larger item) and returns one result per item, in order: a value, or an exception that is raised to
that item's caller alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger("runtime.batching")

T = TypeVar("T")
R = TypeVar("R")


class Overloaded(Exception):
    """The queue is full: answer 503 with Retry-After."""


@dataclass(slots=True)
class _Pending(Generic[T, R]):
    item: T
    rows: int
    key: Hashable
    future: asyncio.Future[R]
    arrived: float


class Batcher(Generic[T, R]):
    """Gathers queued items into calls of ``predict_many`` of up to ``max_batch_size`` rows.

    A batch leaves when it holds ``max_batch_size`` rows, when its oldest item has waited ``max_wait_s``, or as
    soon as the event loop goes quiet (two turns without a new item). A quiet loop means every request the
    server has read is queued already: waiting longer would add latency and gather nothing. So a lone request is
    not held back, while under load, when each turn of the loop brings new items, batches grow up to either
    limit; and while one batch runs on the thread, the next one gathers.

    A batch holds items of one ``key`` only (say, requests with the same parameters), oldest first; items of
    other keys keep their place in the queue. ``max_queue`` bounds the items waiting (not the batch running).
    """

    def __init__(
        self,
        predict_many: Callable[[list[T]], Sequence[R | BaseException]],
        *,
        max_batch_size: int = 64,
        max_wait_s: float = 0.002,
        max_queue: int = 256,
        observe: Callable[[int, int, float], None] | None = None,
        thread_name: str = "predict",
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_s < 0:
            raise ValueError("max_batch_size and max_queue must be at least 1, max_wait_s at least 0")
        self._predict_many = predict_many
        self._max_rows = max_batch_size
        self._max_wait = max_wait_s
        self._max_queue = max_queue
        self._observe = observe  # (rows, items, seconds) of each batch, called on the event loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._queue: deque[_Pending[T, R]] = deque()
        self._queued_rows = 0
        self._arrivals = 0
        self._idle: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        """Items waiting for a batch."""
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self._max_queue

    def start(self) -> None:
        """Start gathering batches; call from within the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def close(self) -> None:
        """Stop gathering; items still queued get ``asyncio.CancelledError``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for pending in self._queue:
            pending.future.cancel()
        self._queue.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the batcher's thread, between batches (say, a warm-up pass)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def submit(self, item: T, rows: int = 1, key: Hashable = None) -> R:
        """Queue ``item`` and wait for its result; raises ``Overloaded`` when the queue is full."""
        if len(self._queue) >= self._max_queue:
            raise Overloaded
        loop = asyncio.get_running_loop()
        pending: _Pending[T, R] = _Pending(item, rows, key, loop.create_future(), loop.time())
        self._queue.append(pending)
        self._queued_rows += rows
        self._arrivals += 1
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return await pending.future

    async def _run(self) -> None:
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
            batch = self._take()
            if batch:
                await self._execute(batch, loop)

    def _take(self) -> list[_Pending[T, R]]:
        """Pop the oldest live item and every later one of its key, up to ``max_rows`` rows."""
        while self._queue and self._queue[0].future.done():  # its caller went away
            self._queued_rows -= self._queue.popleft().rows
        if not self._queue:
            return []
        first = self._queue.popleft()
        batch, rows, key = [first], first.rows, first.key
        kept: list[_Pending[T, R]] = []
        while self._queue and rows < self._max_rows:
            pending = self._queue.popleft()
            if pending.future.done():
                self._queued_rows -= pending.rows
            elif pending.key != key or rows + pending.rows > self._max_rows:
                kept.append(pending)
                if pending.key == key:  # the batch is full for its key
                    break
            else:
                batch.append(pending)
                rows += pending.rows
        self._queue.extendleft(reversed(kept))
        self._queued_rows -= rows
        return batch

    async def _execute(self, batch: list[_Pending[T, R]], loop: asyncio.AbstractEventLoop) -> None:
        started = time.perf_counter()
        items = [p.item for p in batch]
        try:
            results: Sequence[R | BaseException] = await loop.run_in_executor(self._executor, self._predict_many, items)
            if len(results) != len(batch):
                raise RuntimeError(f"predict_many returned {len(results)} results for {len(batch)} items")
        except Exception as exc:  # a bug in predict_many: every caller of the batch gets the error
            log.exception("a batch of %d items failed", len(batch))
            results = [exc] * len(batch)
        if self._observe is not None:
            self._observe(sum(p.rows for p in batch), len(batch), time.perf_counter() - started)
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():  # its caller went away
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
