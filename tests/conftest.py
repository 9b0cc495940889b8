"""Shared fixtures: one Prefect test server and one gpuferry home per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def gpuferry_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Everything the embedded backends write goes to a throwaway directory."""
    home = tmp_path_factory.mktemp("gpuferry-home")
    old = os.environ.get("GPUFERRY_HOME")
    os.environ["GPUFERRY_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("GPUFERRY_HOME", None)
    else:
        os.environ["GPUFERRY_HOME"] = old


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One Prefect test server per session (starting one costs ~15 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
