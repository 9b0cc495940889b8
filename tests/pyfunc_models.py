"""MLflow pyfunc models from code, of one column ``x``, checkpointed with their manifest as a run stores them:
the versions the canary, shadow and serving tests (and ``bench/canary.py``) tell apart by their answers."""

from __future__ import annotations

from pathlib import Path

# y = 2x; with fail, it raises for every x that is a multiple of 5 (its answer: 400, as MLflow's server answers a
# model's error); with differ, it answers 3x for every x that is a multiple of 3.
CANARY_MODEL = """
import mlflow
import numpy as np


class Model(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        x = model_input["x"].to_numpy()
        if {fail} and (x % 5 == 0).any():
            raise ValueError("this version fails on multiples of 5")
        return np.where((x % 3 == 0) & {differ}, 3 * x, 2 * x)


mlflow.models.set_model(Model())
"""


def save_pyfunc(root: Path, name: str, code: str) -> Path:
    """``code`` (a model from code, reading column ``x``) saved as the MLflow model ``root/name``, with its input
    example, signature and manifest."""
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.models import infer_signature

    from blocks.base.storage import write_manifest

    (root / f"{name}.py").write_text(code)
    example = pd.DataFrame({"x": [1.0, 2.0]})
    mlflow.pyfunc.save_model(
        root / name,
        python_model=str(root / f"{name}.py"),
        input_example=example,
        signature=infer_signature(example, example["x"].to_numpy()),
        pip_requirements=["mlflow"],
    )
    write_manifest(root / name)
    return root / name


def canary_models(root: Path) -> dict[str, str]:
    """The URIs of ``good``, ``failing`` and ``differing`` (``CANARY_MODEL``) saved under ``root``."""
    versions = {"good": (False, False), "failing": (True, False), "differing": (False, True)}
    return {
        name: save_pyfunc(root, name, CANARY_MODEL.format(fail=fail, differ=differ)).as_uri()
        for name, (fail, differ) in versions.items()
    }
