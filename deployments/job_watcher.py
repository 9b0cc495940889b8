"""One process that watches every training job a suspended flow run waits for, and resumes the run.

A flow run whose train step uses ``tasks.train.train_suspending`` submits its job, labels itself with
the job's handle and its stack (``register_wait``), then suspends: it holds no process while the job
runs, for hours or days. This watcher finds those runs through the Prefect API (state *Suspended*,
label ``gpuferry.wait.job``), polls their jobs with one batched ``ComputeBackend.poll`` per stack,
and, for each job that ended, emits ``gpuferry.training_job.ended`` and resumes the run. The resumed
run reads the job's result and goes on. Time in the queue and requeues never end a wait. What does
besides the job's end (``blocks/base/watchdog.py``): a job the backend has lost (no record of it for the
stack's ``lost_job_grace_seconds``), and an attempt that ran past the job's time limit on a backend that
does not enforce it itself (the job is cancelled). Then the watcher labels the run with the reason
(``gpuferry.wait.verdict``) and resumes it, and the run fails with that reason.

The labels on the suspended runs are the registry, so a restarted watcher picks up where it left off,
and two watchers at once only resume a run twice (the second is refused by the server). Its only state
is each waiting job's watchdog clocks, in memory: a restarted watcher starts them again.

    python -m deployments.job_watcher --interval 10
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from blocks.base.compute import ComputeBackend
from blocks.base.watchdog import Watchdog
from blocks.errors import JobFailed
from blocks.records import JobStatus
from tasks.waiting import (  # noqa: F401 - re-exported
    JOB_LABEL,
    STACK_LABEL,
    Waiting,
    record_verdict,
    register_wait,
    waiting_from,
)

log = logging.getLogger("gpuferry.job_watcher")

ENDED_EVENT = "gpuferry.training_job.ended"
SUSPENDED = "Suspended"


def read_waiting(page_size: int = 200) -> list[Waiting]:
    """Every suspended flow run that waits for a job (all pages)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateName,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    flt = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.PAUSED]),
            name=FlowRunFilterStateName(any_=[SUSPENDED]),
        )
    )
    found: list[Waiting] = []
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            runs = client.read_flow_runs(flow_run_filter=flt, limit=page_size, offset=offset)
            found.extend(w for w in map(waiting_from, runs) if w is not None)
            if len(runs) < page_size:
                return found
            offset += page_size


def resume(waiting: Waiting, status: JobStatus) -> bool:
    """Emit the job's end event and resume its flow run; False when the server refused (already resumed)."""
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event

    emit_event(
        event=ENDED_EVENT,
        resource={
            "prefect.resource.id": f"gpuferry.training-job.{waiting.handle.job_id}",
            "backend": waiting.handle.backend,
            "state": status.state,
        },
        related=[
            {
                "prefect.resource.id": f"prefect.flow-run.{waiting.flow_run_id}",
                "prefect.resource.role": "flow-run",
                "prefect.resource.name": waiting.flow_run_name,
            }
        ],
        payload={"exit_code": status.exit_code, "reason": status.reason, "stack": waiting.stack},
    )
    with get_client(sync_client=True) as client:
        result = client.resume_flow_run(waiting.flow_run_id)
    accepted = getattr(result.status, "value", str(result.status)) == "ACCEPT"
    if not accepted:
        log.info("flow run %s was not resumed: %s", waiting.flow_run_name, result.details)
    return accepted


def give_up(waiting: Waiting, failure: JobFailed) -> bool:
    """End the wait for a job that did not end (lost, or past its time limit): label the run with the reason,
    which its resumed train step raises, then resume it as for an ended job."""
    record_verdict(waiting.flow_run_id, waiting.handle, failure)
    state = failure.state if failure.state in ("FAILED", "TIMEOUT") else "FAILED"
    return resume(waiting, JobStatus(job_id=waiting.handle.job_id, state=state, reason=str(failure)[:2000]))


class JobWatcher:
    """Polls the jobs of all waiting flow runs, one batched query per stack, and resumes the finished ones
    (and those whose job it gave up on: ``on_failed``)."""

    def __init__(
        self,
        *,
        load_compute: Callable[[str], ComputeBackend] | None = None,
        read: Callable[[], list[Waiting]] = read_waiting,
        on_ended: Callable[[Waiting, JobStatus], bool] = resume,
        on_failed: Callable[[Waiting, JobFailed], bool] = give_up,
    ) -> None:
        self._load_compute = load_compute or _stack_compute
        self._computes: dict[str, ComputeBackend] = {}
        self._watchdogs: dict[tuple[Any, str], Watchdog] = {}  # (flow run id, job id) -> its clocks
        self.read = read
        self.on_ended = on_ended
        self.on_failed = on_failed
        self.polls = 0  # batched backend queries made (for the benchmarks)

    def compute(self, stack: str) -> ComputeBackend:
        if stack not in self._computes:
            self._computes[stack] = self._load_compute(stack)
        return self._computes[stack]

    def poll_once(self) -> list[Waiting]:
        """One round: read the waiting runs, poll their jobs, resume those whose job ended (or was lost). Returns
        those."""
        by_stack: dict[str, list[Waiting]] = defaultdict(list)
        for waiting in self.read():
            by_stack[waiting.stack].append(waiting)
        ended: list[Waiting] = []
        watching: set[tuple[Any, str]] = set()
        for stack, group in by_stack.items():
            try:
                compute = self.compute(stack)
                statuses = compute.poll([w.handle for w in group])
            except Exception:  # one stack's outage must not stop the others; retried next round
                log.exception(
                    "polling %d jobs of stack %r failed; retrying next round", len(group), stack or "embedded"
                )
                self._computes.pop(stack, None)
                watching.update((w.flow_run_id, w.handle.job_id) for w in group)  # their clocks go on
                continue
            self.polls += 1
            for waiting in group:
                status = statuses.get(waiting.handle.job_id)
                if status is None:
                    continue
                if status.terminal:
                    log.info(
                        "job %s of %s ended %s: resuming it", waiting.handle.job_id, waiting.flow_run_name, status.state
                    )
                    self.on_ended(waiting, status)
                    ended.append(waiting)
                    continue
                key = (waiting.flow_run_id, waiting.handle.job_id)
                if key not in self._watchdogs:
                    self._watchdogs[key] = Watchdog(compute, waiting.handle, waiting.time_limit_seconds)
                watchdog = self._watchdogs[key]
                watchdog.backend = compute  # the stack's backend may have been loaded afresh since
                failure = watchdog.check(status)
                if failure is None:
                    watching.add(key)
                    continue
                log.warning("resuming %s to fail it: %s", waiting.flow_run_name, str(failure).splitlines()[0])
                self.on_failed(waiting, failure)
                ended.append(waiting)
        self._watchdogs = {key: dog for key, dog in self._watchdogs.items() if key in watching}
        return ended

    def run(self, interval_seconds: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Poll every ``interval_seconds`` until ``stop()``; a failed round is logged and retried."""
        while not stop():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # the Prefect API hiccuped; the next round retries
                log.exception("watch round failed; retrying in %.0f s", interval_seconds)
            time.sleep(max(0.0, interval_seconds - (time.monotonic() - started)))


def _stack_compute(stack: str) -> ComputeBackend:
    from blocks.stack import load_stack

    return load_stack(stack or None).compute


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between two rounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call otherwise
    if args.interval <= 0:
        parser.error("--interval must be positive")
    watcher = JobWatcher()
    try:
        watcher.run(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
