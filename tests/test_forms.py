"""A workload deployment's form (deployments/forms.py), as the schema the Prefect server gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from blocks.workload.source import load_workload
from deployments.forms import _flow_schema, workload_schema
from tests.examples import DIABETES, DIGITS


@pytest.mark.parametrize("flow", ["retrain", "sweep"])
def test_the_deployment_pins_its_workload_and_the_form_requires_nothing_else(flow: str) -> None:
    signature = _flow_schema(flow)
    assert "workload" in signature["required"]  # the flow itself needs one ...
    schema = workload_schema(signature, load_workload(str(DIABETES)), "examples/diabetes")
    # ... the deployment gives it: fixed to its workload, so the UI's Quick run needs no dialog.
    assert schema["properties"]["workload"]["enum"] == ["examples/diabetes"]
    assert schema["properties"]["workload"]["default"] == "examples/diabetes"
    assert "workload" not in schema.get("required", [])
    assert "workload" in signature["required"]  # the flow's own schema is left as it was


def test_the_form_offers_the_workloads_own_hyperparameters() -> None:
    workload = load_workload(str(DIGITS))
    schema = workload_schema(_flow_schema("retrain"), workload, "examples/digits")
    hyperparameters = schema["definitions"]["TrainingSpec"]["properties"]["hyperparameters"]
    assert list(hyperparameters["properties"]) == list(workload.definition.schema.names)
    assert hyperparameters["default"] == workload.definition.schema.defaults


NESTED = Path(__file__).resolve().parent / "workloads" / "nested"


def test_nested_hyperparameters_are_closed_ordered_and_named_at_every_level() -> None:
    """An object inside the hyperparameters is a form of its own: its fields in the file's order, its defaults
    filled in, and the server's check (Prefect's own validator, as the server runs it) refuses a bad nested value
    or an unknown nested key naming the field and the valid keys."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    workload = load_workload(str(NESTED))
    schema = workload_schema(_flow_schema("retrain"), workload, "tests/workloads/nested")
    form = schema["definitions"]["TrainingSpec"]["properties"]["hyperparameters"]
    optimizer = form["properties"]["optimizer"]
    assert [(k, v["position"]) for k, v in optimizer["properties"].items()] == [("kind", 0), ("lr", 1), ("schedule", 2)]
    assert optimizer["additionalProperties"] is False
    assert optimizer["properties"]["schedule"]["propertyNames"] == {"enum": ["warmup_steps", "decay"]}
    assert form["default"]["optimizer"] == {
        "kind": "sgd",
        "lr": 0.01,
        "schedule": {"warmup_steps": 100, "decay": "cosine"},
    }

    def refused(hyperparameters: dict) -> str:
        with pytest.raises(ValidationError) as info:
            validate({"training": {"hyperparameters": hyperparameters}}, schema, raise_on_error=True)
        return str(info.value)

    assert (
        validate(
            {"training": {"hyperparameters": {"optimizer": {"schedule": {"decay": "none"}}, "layers": [8]}}},
            schema,
            raise_on_error=True,
        )
        == []
    )
    assert refused({"optimizer": {"schedule": {"decay": "step"}}}) == (
        "Validation failed for field 'training.hyperparameters.optimizer.schedule.decay'. Failure reason: 'step' is "
        "not one of ['none', 'cosine', 'linear']"
    )
    assert refused({"optimizer": {"schedule": {"warmpu": 3}}}) == (
        "Validation failed for field 'training.hyperparameters.optimizer.schedule'. Failure reason: 'warmpu' is not "
        "one of ['warmup_steps', 'decay']"
    )
    assert "field 'training.hyperparameters.layers[1]'. Failure reason: 0 is less than the minimum of 1" in refused(
        {"layers": [4, 0]}
    )
    # The run's own check agrees, and a nested object left out gets its fields' defaults.
    assert workload.definition.schema.validate({"optimizer": {"lr": 0.1}}) == {
        "epochs": 3,
        "layers": [64, 32],
        "optimizer": {"kind": "sgd", "lr": 0.1, "schedule": {"warmup_steps": 100, "decay": "cosine"}},
    }
