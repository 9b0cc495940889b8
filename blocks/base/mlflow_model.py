"""The MLflow model a training job writes to ``$CHECKPOINT_DIR/final/``: checked before it is stored or registered.

MLflow registers a version whatever its source holds (it does not look), so a job that wrote no model, or
a broken one, would otherwise end as a registered version nothing can serve. ``check_mlflow_model(dir)``
reads the ``MLmodel`` file (``runtime/mlmodel.py``, which a cluster runs too) and says what the model is: its
flavours, whether it has a signature, and its serving input example (the request gpuferry's deploy gate sends),
or raises ``NoModel`` saying what to write. Pure: reads only the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from blocks.errors import GpuferryError
from runtime import mlmodel
from runtime.mlmodel import MLMODEL, serving_example_path  # noqa: F401 - re-exported


class NoModel(GpuferryError):
    """The job's ``final/`` holds no readable MLflow model: nothing is stored or registered. Not transient."""


class ModelInfo(BaseModel):
    """What an MLflow model directory holds, from its ``MLmodel``."""

    model_config = ConfigDict(frozen=True)

    flavors: list[str]
    pyfunc: bool
    signature: bool
    serving_example: str | None = None  # relative path of the ready-to-POST request, when the model has one


def check_mlflow_model(directory: str | Path) -> ModelInfo:
    """The MLflow model in ``directory``; ``NoModel`` when there is none or its ``MLmodel`` is unreadable."""
    try:
        return ModelInfo(**mlmodel.read_model(directory))
    except mlmodel.NoModel as exc:
        raise NoModel(str(exc)) from None


def parse_serving_example(raw: bytes, where: str) -> dict[str, Any]:
    """A model's serving input example: a JSON object (one of MLflow's request formats)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise NoModel(f"{where} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise NoModel(f"{where} is not a JSON object (an MLflow scoring request)")
    return body
