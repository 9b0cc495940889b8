"""Where the blocks log: the Prefect run's logger inside a flow or task run (its lines go to the run's logs in the
UI), else a plain logger of the block's name, so a block works the same from the CLI, a test or a script."""

from __future__ import annotations

import logging
import re
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def run_logger(fallback: str = "gpuferry") -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run, else a plain logger."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)


class RunProgress:
    """A progress artifact of the Prefect run (shown on the run's page, kept with it), or nothing outside a flow or
    task run: a block reports progress the same way from a deploy run, the CLI or a test. An artifact the server
    does not take is logged and dropped: progress is never why a step fails."""

    def __init__(self, key: str, description: str) -> None:
        self.key = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")  # Prefect's artifact keys
        self._id: UUID | None = None
        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            return
        try:
            self._id = cast(UUID, create_progress_artifact(0.0, key=self.key, description=description))  # sync here
        except Exception as exc:  # noqa: BLE001 - progress is a courtesy; the step goes on
            run_logger().warning("progress of %s not recorded: %s", self.key, exc)

    def update(self, percent: float, description: str) -> None:
        if self._id is None:
            return
        try:
            update_progress_artifact(self._id, max(0.0, min(100.0, percent)), description=description)
        except Exception as exc:  # noqa: BLE001 - as above
            run_logger().warning("progress of %s not recorded: %s", self.key, exc)
