"""The sweep's grid (validated before anything runs) and its refusal on a backend without job arrays."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from blocks.errors import ConfigurationError
from blocks.specs import HyperParameters, SweepGrid
from blocks.stack import Stack


def test_grid_is_the_cartesian_product_on_the_base() -> None:
    grid = SweepGrid(values={"lr": [0.1, 0.01], "hidden": [16, 32, 64]}, configurations=[{"optimizer": "adam"}])
    assert grid.size == 7
    configs = grid.expand(HyperParameters(epochs=3))
    assert [(c.lr, c.hidden) for c in configs[:6]] == [(0.1, 16), (0.1, 32), (0.1, 64), (0.01, 16), (0.01, 32), (0.01, 64)]
    assert configs[6] == HyperParameters(epochs=3, optimizer="adam")
    assert all(c.epochs == 3 for c in configs)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"values": {"learning_rate": [0.1]}}, r"values\['learning_rate'\]: not a hyperparameter; use one of: epochs, lr"),
        ({"values": {"lr": []}}, r"values\['lr'\] is empty"),
        ({"values": {"lr": [0.1, 0.1]}}, r"values\['lr'\] lists a value twice"),
        ({"values": {"lr": [0.1, -1.0]}}, r"configuration 1 \{'lr': -1.0\}.*lr"),
        ({"configurations": [{"optimizer": "rmsprop"}]}, r"configuration 0 .*optimizer"),
        ({"configurations": [{"depth": 3}]}, r"configurations\[0\]: depth not hyperparameters"),
        ({}, "the sweep is empty"),
        ({"values": {"lr": [0.1, 0.2], "seed": list(range(6))}, "max_configurations": 10},
         "12 configurations, more than max_configurations=10"),
    ],
)
def test_bad_grids_are_refused_naming_the_field(grid: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SweepGrid(**grid)


def test_base_hyperparameters_are_checked_with_each_configuration() -> None:
    grid = SweepGrid(values={"dropout": [0.0, 0.5]})
    assert len(grid.expand(HyperParameters())) == 2
    with pytest.raises(ValueError, match="configuration 0"):
        SweepGrid(configurations=[{"lr": 20.0}])


@pytest.mark.usefixtures("prefect_server")
def test_embedded_stack_refuses_a_sweep_before_anything_runs() -> None:
    from flows.sweep import sweep

    jobs = Stack.embedded().compute.job_workdir("x")
    with pytest.raises(ConfigurationError, match="no job arrays.*Slurm.*retrain"):
        sweep(grid=SweepGrid(values={"lr": [0.1, 0.2]}))
    from pathlib import Path

    assert not any(Path(jobs).parent.glob("*-sweep"))  # nothing was submitted
