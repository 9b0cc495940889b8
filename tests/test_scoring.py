"""runtime.scoring in-process: what a batch of the column fast path hands the model is what MLflow's own schema
enforcement would hand it (the fast path skips that step for input of the signature's exact types)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
import pytest
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, DataType, Schema

from runtime.scoring import Scorer


class Recorder(mlflow.pyfunc.PythonModel):
    """Answers, for every row, what it was given: input type, columns, dtypes, and the row's values."""

    def predict(self, context, model_input, params=None):
        seen = f"{type(model_input).__name__} {list(model_input.columns)} {[str(t) for t in model_input.dtypes]}"
        return [f"{seen} {row}" for row in model_input.to_numpy().tolist()]


SIGNATURES = {
    "all double (one block)": [("b", DataType.double), ("a", DataType.double), ("c", DataType.double)],
    "mixed numbers": [("b", DataType.double), ("a", DataType.long), ("c", DataType.float)],
    "with strings": [("b", DataType.double), ("a", DataType.string)],
}


def _load(tmp_path: Path, columns: list[tuple[str, DataType]]) -> mlflow.pyfunc.PyFuncModel:
    signature = ModelSignature(inputs=Schema([ColSpec(t, name) for name, t in columns]))
    mlflow.pyfunc.save_model(tmp_path / "model", python_model=Recorder(), signature=signature, pip_requirements=[])
    return mlflow.pyfunc.load_model(str(tmp_path / "model"))


def _value(kind: DataType, i: int) -> object:
    if kind == DataType.double and i % 10 == 1:
        return None  # missing: NaN
    return f"s{i}" if kind == DataType.string else (i if kind == DataType.long else i + 0.5)


@pytest.mark.parametrize("case", SIGNATURES)
def test_a_column_batch_is_what_mlflows_schema_enforcement_gives_the_model(tmp_path: Path, case: str) -> None:
    columns = SIGNATURES[case]
    model = _load(tmp_path, columns)
    scorer = Scorer(model, max_request_rows=16)
    sent = [name for name, _ in reversed(columns)]  # another order than the signature's
    bodies, frames = [], []
    for i in range(5):  # requests of 1, 2, 1, 2, 1 rows
        rows = [[_value(dict(columns)[name], 10 * i + r) for name in sent] for r in range(1 + i % 2)]
        bodies.append(json.dumps({"dataframe_split": {"columns": sent, "data": rows}}).encode())
        # MLflow's enforcement takes no float64 for a float column; the fast path's float32 is the same numbers
        floats = {name: "float32" for name, kind in columns if kind == DataType.float}
        frames.append(pd.DataFrame(rows, columns=sent).astype(floats))
    items = [scorer.parse(body, "application/json") for body in bodies]
    assert all(item is not None for item in items), "the fast path takes these requests"

    answers = [json.loads(answer)["predictions"] for answer in scorer.predict_many(items)]

    expected = [model.predict(frame) for frame in frames]  # through MLflow's schema enforcement
    assert answers == expected
    assert answers[0][0].startswith(f"DataFrame {[name for name, _ in columns]}")
    assert scorer.fallbacks == 0
