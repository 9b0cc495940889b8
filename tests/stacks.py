"""Connection settings of the local stacks that `make <stack>-up` starts (scripts/<stack>.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def stacks_root() -> Path:
    default = Path(os.environ.get("GPUFERRY_CACHE", Path.home() / ".cache" / "gpuferry")) / "stacks"
    return Path(os.environ.get("GPUFERRY_STACKS", default))


def stack_env(name: str) -> dict[str, str]:
    """The KEY=VALUE lines `scripts/<name>.sh up` wrote, or skip/fail when the stack is not up.

    Under `make test` (GPUFERRY_REQUIRE_STACKS=1) a missing stack fails the test: `make test`
    starts every stack, so a missing one is a bug, not a reason to skip.
    """
    path = stacks_root() / name / "env"
    if not path.exists():
        message = f"the {name} stack is not up: run `make {name}-up` ({path} missing)"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env
