"""Where a planted secret must not turn up, read by the tests that plant one: every process's command line
while a run goes on, and the Prefect logs of a flow run."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from pathlib import Path


class CommandLines:
    """Every process's command line, sampled from /proc until stopped."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    with contextlib.suppress(OSError):
                        self.seen.add((entry / "cmdline").read_bytes())
            self._stop.wait(0.1)

    def stop(self) -> set[bytes]:
        self._stop.set()
        self._thread.join(30)
        return self.seen


def flow_run_logs(flow_run_id: uuid.UUID, *, until: str | None = None, timeout: float = 120) -> list[str]:
    """Every log message of the flow run (its tasks' too) on the Prefect server, read page by page (the server
    answers at most its default limit of entries a request). ``until``: read again until a message contains it
    (a process sends its logs in batches, in the background: the last may land after the flow has returned)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    async def read() -> list[str]:
        messages: list[str] = []
        async with get_client() as prefect:
            while True:
                page = await prefect.read_logs(
                    log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                    limit=PAGE,
                    offset=len(messages),
                    sort=LogSort.TIMESTAMP_ASC,
                )
                messages += [entry.message for entry in page]
                if len(page) < PAGE:
                    return messages

    send_logs_now()
    deadline = time.monotonic() + timeout
    while True:
        messages = asyncio.run(read())
        if messages and (until is None or any(until in m for m in messages)):
            return messages
        if time.monotonic() > deadline:
            raise AssertionError(
                f"flow run {flow_run_id}: {len(messages)} log messages, none says {until!r}, after {timeout} s"
            )
        time.sleep(1)


PAGE = 200


def send_logs_now(timeout: float = 60) -> None:
    """Send what this process's Prefect log workers hold and stop them; the next log starts a fresh worker on
    the current API. Called before a run whose logs a test reads (a worker an earlier test left stuck or
    behind would hold them) and before reading them (they go in background batches)."""
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout)
