"""A workload deployment's form (deployments/forms.py), as the schema the Prefect server gets."""

from __future__ import annotations

import pytest

from blocks.workload import load_workload
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
