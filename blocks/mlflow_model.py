"""The MLflow model a training job writes to ``$CHECKPOINT_DIR/final/``: checked before it is stored or registered.

MLflow registers a version whatever its source holds (it does not look), so a job that wrote no model, or
a broken one, would otherwise end as a registered version nothing can serve. ``check_mlflow_model(dir)``
reads the ``MLmodel`` file (YAML) and says what the model is: its flavours, whether it has a signature, and
its serving input example (the request gpuferry's deploy gate sends), or raises ``NoModel`` saying what to
write. Pure: reads only the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from blocks.errors import GpuferryError

MLMODEL = "MLmodel"
HOW_TO_SAVE = (
    "save an MLflow model there at the end of training, e.g. "
    "mlflow.sklearn.save_model(model, os.environ['CHECKPOINT_DIR'] + '/final', input_example=X[:2]) "
    "(any flavour: mlflow.pytorch, mlflow.transformers, mlflow.pyfunc, ...)"
)


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
    root = Path(directory)
    path = root / MLMODEL
    if not root.is_dir():
        raise NoModel(f"the training job wrote nothing to {root}: {HOW_TO_SAVE}")
    if not path.is_file():
        found = sorted(p.name for p in root.iterdir())[:10]
        raise NoModel(
            f"{root} holds no MLflow model (no {MLMODEL} file; found: {', '.join(found) or 'nothing'}): {HOW_TO_SAVE}"
        )
    try:
        meta = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise NoModel(f"{path} is not readable YAML ({exc}): {HOW_TO_SAVE}") from None
    flavors = meta.get("flavors") if isinstance(meta, dict) else None
    if not isinstance(flavors, dict) or not flavors:
        raise NoModel(f"{path} names no flavours: not an MLflow model; {HOW_TO_SAVE}")
    serving = serving_example_path(path.read_bytes())
    if serving and not (root / serving).is_file():
        serving = None
    return ModelInfo(
        flavors=sorted(flavors), pyfunc="python_function" in flavors, signature=bool(meta.get("signature")),
        serving_example=serving,
    )  # fmt: skip


def serving_example_path(mlmodel: bytes) -> str | None:
    """The serving input example an ``MLmodel`` file names (relative to the model), or None."""
    try:
        meta = yaml.safe_load(mlmodel)
    except yaml.YAMLError:
        return None
    info = meta.get("saved_input_example_info") if isinstance(meta, dict) else None
    path = info.get("serving_input_path") if isinstance(info, dict) else None
    return path if isinstance(path, str) and path else None


def parse_serving_example(raw: bytes, where: str) -> dict[str, Any]:
    """A model's serving input example: a JSON object (one of MLflow's request formats)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise NoModel(f"{where} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise NoModel(f"{where} is not a JSON object (an MLflow scoring request)")
    return body
