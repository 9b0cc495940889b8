"""Where the blocks log: the Prefect run's logger inside a flow or task run (its lines go to the run's logs in the
UI), else a plain logger of the block's name, so a block works the same from the CLI, a test or a script."""

from __future__ import annotations

import logging

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def run_logger(fallback: str = "gpuferry") -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run, else a plain logger."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
