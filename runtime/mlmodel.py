"""The MLflow model a training job writes to ``$CHECKPOINT_DIR/final/``, read from its ``MLmodel`` file.

``read_model(dir)`` says what the model is (its flavours, whether it has a signature, its serving input example)
or raises ``NoModel`` saying what to write. Shared by the orchestrator (``blocks/base/mlflow_model.py``) and
``python -m runtime.store`` on a cluster; PyYAML only (MLflow brings it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MLMODEL = "MLmodel"
HOW_TO_SAVE = (
    "save an MLflow model there at the end of training, e.g. "
    "mlflow.sklearn.save_model(model, os.environ['CHECKPOINT_DIR'] + '/final', input_example=X[:2]) "
    "(any flavour: mlflow.pytorch, mlflow.transformers, mlflow.pyfunc, ...)"
)


class NoModel(ValueError):
    """The directory holds no readable MLflow model."""


def serving_example_path(mlmodel: bytes) -> str | None:
    """The serving input example an ``MLmodel`` file names (relative to the model), or None."""
    try:
        meta = yaml.safe_load(mlmodel)
    except yaml.YAMLError:
        return None
    info = meta.get("saved_input_example_info") if isinstance(meta, dict) else None
    path = info.get("serving_input_path") if isinstance(info, dict) else None
    return path if isinstance(path, str) and path else None


def read_model(directory: str | Path) -> dict[str, Any]:
    """``{"flavors", "pyfunc", "signature", "serving_example"}`` of the MLflow model in ``directory``; ``NoModel``
    when there is none or its ``MLmodel`` is unreadable."""
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
    return {
        "flavors": sorted(flavors),
        "pyfunc": "python_function" in flavors,
        "signature": bool(meta.get("signature")),
        "serving_example": serving,
    }
