"""What a suspended flow run waits for, as labels on the run: the job's handle, the stack that polls it and
the job's time limit per attempt.

The train step (``tasks/train.py``) labels its run before it suspends; the job watcher
(``deployments/job_watcher.py``) reads the labels back and resumes the run when the job ended. When the
watcher gives up on a job that has not ended (``blocks/base/watchdog.py``: the backend lost it, or an attempt ran
past its time limit), it labels the run with its verdict before resuming it, and the resumed train step fails
with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from blocks.errors import JobFailed
from blocks.records import JobHandle

log = logging.getLogger("gpuferry.job_watcher")

JOB_LABEL = "gpuferry.wait.job"
STACK_LABEL = "gpuferry.wait.stack"
TIME_LIMIT_LABEL = "gpuferry.wait.time_limit_seconds"
VERDICT_LABEL = "gpuferry.wait.verdict"
_VERDICT_CHARS = 4000

# What every run says of itself, as labels (`gpuferry runs`, `logs`, `cancel` read them back): the saved stack it
# runs on ('' for the embedded one), the job it submitted (its handle), and the model version it registered.
RUN_STACK_LABEL = "gpuferry.stack"
RUN_JOB_LABEL = "gpuferry.job"
RUN_MODEL_LABEL = "gpuferry.model_version"


def label_run(labels: dict[str, str]) -> None:
    """Label the current flow run (none outside one); a failure to label is logged, never the run's failure."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(context.flow_run.id, dict(labels))
    except Exception as exc:  # noqa: BLE001 - the labels serve the CLI; the run goes on without them
        log.warning("could not label flow run %s with %s: %s", context.flow_run.id, sorted(labels), exc)


def stop_if_cancelled(what: str) -> None:
    """Raise Prefect's Abort when the current flow run was cancelled on the server (`gpuferry cancel`, the UI)
    while this process ran it: the run then stays Cancelled instead of ending Failed on the job it cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.exceptions import Abort

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(context.flow_run.id).state
    if state is not None and (state.is_cancelled() or state.is_cancelling()):
        raise Abort(f"{what}: the flow run was cancelled ({state.message or state.name})")


def _current_run(flow_run_id: UUID | str | None, what: str) -> UUID:
    from prefect.context import FlowRunContext

    if flow_run_id is None:
        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            raise RuntimeError(f"{what} needs a flow run: call it from a flow or pass flow_run_id")
        flow_run_id = context.flow_run.id
    return UUID(str(flow_run_id))


def register_wait(
    handle: JobHandle,
    stack: str = "",
    flow_run_id: UUID | str | None = None,
    *,
    time_limit_seconds: float | None = None,
) -> None:
    """Label the (current) flow run with the job it waits for, so the watcher resumes it when the job ends
    (``time_limit_seconds``: the job's limit per attempt, for a backend that does not enforce it itself)."""
    from prefect.client.orchestration import get_client

    run_id = _current_run(flow_run_id, "register_wait")
    labels: dict[str, bool | int | float | str] = {
        JOB_LABEL: handle.model_dump_json(),
        STACK_LABEL: stack or "",
        TIME_LIMIT_LABEL: "" if time_limit_seconds is None else str(float(time_limit_seconds)),
    }
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(run_id, labels)


def record_verdict(flow_run_id: UUID | str, handle: JobHandle, failure: JobFailed) -> None:
    """Label the run with why the wait for ``handle`` ended without the job's end (the watcher, before it resumes)."""
    from prefect.client.orchestration import get_client

    message = str(failure)
    if len(message) > _VERDICT_CHARS:
        message = message[: _VERDICT_CHARS - 1] + "…"
    verdict = {"job_id": handle.job_id, "state": failure.state, "message": message}
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(UUID(str(flow_run_id)), {VERDICT_LABEL: json.dumps(verdict)})


def verdict_from(labels: dict[str, Any] | None, handle: JobHandle) -> JobFailed | None:
    """The watcher's verdict on job ``handle`` among a run's labels, as the failure to raise (pure)."""
    raw = (labels or {}).get(VERDICT_LABEL)
    try:
        verdict = json.loads(raw) if raw else None
    except (ValueError, TypeError):
        log.warning("unreadable %s label: ignored", VERDICT_LABEL)
        return None
    if not isinstance(verdict, dict) or verdict.get("job_id") != handle.job_id:
        return None  # none, or about a job an earlier attempt of the run waited for
    return JobFailed(str(verdict.get("message", "")), state=str(verdict.get("state") or "FAILED"))


def wait_verdict(handle: JobHandle, flow_run_id: UUID | str | None = None) -> JobFailed | None:
    """The job watcher's verdict on ``handle`` recorded on the (current) flow run, if it gave up on the job."""
    from prefect.client.orchestration import get_client

    run_id = _current_run(flow_run_id, "wait_verdict")
    with get_client(sync_client=True) as client:
        return verdict_from(client.read_flow_run(run_id).labels, handle)


@dataclass(frozen=True)
class Waiting:
    """A suspended flow run and the job it waits for."""

    flow_run_id: UUID
    flow_run_name: str
    stack: str
    handle: JobHandle
    time_limit_seconds: float | None = None


def waiting_from(run: Any) -> Waiting | None:
    """The ``Waiting`` of a flow run read from the API, or None when it waits for no job of ours (pure)."""
    labels = run.labels or {}
    raw = labels.get(JOB_LABEL)
    if not raw:
        return None
    try:
        handle = JobHandle.model_validate(json.loads(raw))
    except (ValueError, TypeError):
        log.warning("flow run %s has an unreadable %s label: ignored", run.name, JOB_LABEL)
        return None
    try:
        limit = float(labels.get(TIME_LIMIT_LABEL) or "nan")
    except (ValueError, TypeError):
        limit = float("nan")
    return Waiting(
        flow_run_id=run.id,
        flow_run_name=run.name,
        stack=str(labels.get(STACK_LABEL) or ""),
        handle=handle,
        time_limit_seconds=limit if limit > 0 else None,
    )
