"""Bad input is rejected before anything runs, naming the field and what is allowed."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec


@pytest.mark.parametrize(
    ("data", "field", "hint"),
    [
        ({"resources": {"gpus_per_node": -1}}, "resources.gpus_per_node", "greater than or equal to 0"),
        ({"resources": {"nodes": 0}}, "resources.nodes", "greater than or equal to 1"),
        ({"hyperparameters": ["lr", 0]}, "hyperparameters", "valid dictionary"),
        ({"epochs": 3}, "epochs", "Extra inputs are not permitted"),
        ({"model_name": "bad name; rm -rf /"}, "model_name", "letters, digits"),
        ({"resources": {"partition": "gpu$(reboot)"}}, "resources.partition", "letters, digits"),
    ],
)
def test_training_spec_rejects(data: dict, field: str, hint: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainingSpec.model_validate(data)
    errors = info.value.errors()
    assert [".".join(map(str, e["loc"])) for e in errors] == [field]
    assert hint in str(info.value)


def test_serving_spec_mig_typo_lists_profiles() -> None:
    with pytest.raises(ValidationError) as info:
        ServingSpec(mig_profile="1g.10g")
    message = str(info.value)
    assert "mig_profile='1g.10g' is not a MIG profile" in message
    assert "1g.10gb" in message


def test_serving_spec_gpu_and_mig_exclusive() -> None:
    with pytest.raises(ValidationError, match="either gpus or mig_profile"):
        ServingSpec(gpus=1, mig_profile="1g.10gb")


@pytest.mark.parametrize(
    ("direction", "candidate", "champion", "expected"),
    [
        ("maximize", 0.9, None, True),
        ("maximize", 0.9, 0.8, True),
        ("maximize", 0.8, 0.8, False),
        ("maximize", 0.7, 0.8, False),
        ("minimize", 0.2, 0.3, True),
        ("minimize", 0.3, 0.2, False),
    ],
)
def test_promotion_policy(direction: str, candidate: float, champion: float | None, expected: bool) -> None:
    assert PromotionPolicy(metric="m", direction=direction).beats(candidate, champion) is expected


def test_promotion_min_improvement() -> None:
    policy = PromotionPolicy(metric="m", direction="maximize", min_improvement=0.05)
    assert not policy.beats(0.84, 0.8)
    assert policy.beats(0.86, 0.8)


def test_promotion_without_the_workload_says_so() -> None:
    with pytest.raises(ValueError, match="fills them in from the workload"):
        PromotionPolicy().beats(0.9, 0.8)


def test_a_runs_serving_overrides_the_declared_shape_field_by_field() -> None:
    from blocks.specs import ServingShape

    declared = ServingShape(replicas=2, gpus=2, memory_request="4Gi", url="https://m.example.org")
    assert ServingSpec().over(declared).shape() == declared  # nothing set: as declared
    assert ServingSpec().over(None) == ServingSpec()
    mine = ServingSpec(replicas=4, cpu_limit="3").over(declared)
    assert (mine.replicas, mine.gpus, mine.memory_request, mine.cpu_limit) == (4, 2, "4Gi", "3")
    # Setting one GPU field sets what a replica's GPUs are: no GPU at all here, not the declared two.
    cpu = ServingSpec(gpus=0).over(declared)
    assert (cpu.gpus, cpu.device) == (0, "cpu")
    shared = ServingSpec(share_gpus=True).over(declared)
    assert (shared.gpus, shared.share_gpus, shared.device) == (0, True, "cuda")
    with pytest.raises(ValidationError, match="max_replicas=1 is below replicas=2"):
        ServingSpec(max_replicas=1).over(declared)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"cpu_request": "two"}, "cpu_request='two' is not a Kubernetes quantity"),
        ({"url": "houses.example.org"}, "url='houses.example.org' is not an http(s) URL"),
        ({"share_gpus": True, "mig_profile": "1g.10gb"}, "nor share_gpus with a MIG slice"),
    ],
)
def test_a_bad_serving_shape_is_refused_naming_the_field(fields: dict, problem: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(problem)):
        ServingSpec(**fields)
