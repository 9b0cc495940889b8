"""What a suspended flow run waits for, as labels on the run: the job's handle and the stack that polls it.

The train step (``tasks/train.py``) labels its run before it suspends; the job watcher
(``deployments/job_watcher.py``) reads the labels back and resumes the run when the job ended.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from blocks.specs import JobHandle

log = logging.getLogger("gpuferry.job_watcher")

JOB_LABEL = "gpuferry.wait.job"
STACK_LABEL = "gpuferry.wait.stack"


def register_wait(handle: JobHandle, stack: str = "", flow_run_id: UUID | str | None = None) -> None:
    """Label the (current) flow run with the job it waits for, so the watcher resumes it when the job ends."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    if flow_run_id is None:
        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            raise RuntimeError("register_wait needs a flow run: call it from a flow or pass flow_run_id")
        flow_run_id = context.flow_run.id
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(
            UUID(str(flow_run_id)), {JOB_LABEL: handle.model_dump_json(), STACK_LABEL: stack or ""}
        )


@dataclass(frozen=True)
class Waiting:
    """A suspended flow run and the job it waits for."""

    flow_run_id: UUID
    flow_run_name: str
    stack: str
    handle: JobHandle


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
    return Waiting(flow_run_id=run.id, flow_run_name=run.name, stack=str(labels.get(STACK_LABEL) or ""), handle=handle)
