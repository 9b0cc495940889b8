"""What the tests of `gpuferry check` share: the local stack's steps, the Prefect stack's server, and a check
of a stack file that must return within its deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blocks.checks import CheckRow
from blocks.stack_file import read_stack_file
from blocks.storage.s3 import S3CheckpointStore
from deployments.prefect_check import prefect_group
from tests.stack_files import S3_SECRET_ENV, local_stack, write
from tests.stacks import stack_env

GREEN = ("ok",)
# How long past its deadline a check may take to return: starting the groups' threads and reading the stack on a
# machine shared with other jobs. The bound is the behaviour under test (a dead or hung backend does not hold the
# command up), not its speed.
SLACK_S = 20.0


@pytest.fixture(scope="module")
def steps(s3_store: S3CheckpointStore) -> Iterator[dict[str, Any]]:
    """The local stack's steps (a bucket of this module's own), with the S3 secret in the environment."""
    secret = stack_env("s3")["AWS_SECRET_ACCESS_KEY"]
    old = os.environ.get(S3_SECRET_ENV)
    os.environ[S3_SECRET_ENV] = secret
    yield local_stack(s3_store.bucket.bucket_name)
    if old is None:
        os.environ.pop(S3_SECRET_ENV, None)
    else:
        os.environ[S3_SECRET_ENV] = old


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = stack_env("prefect")["PREFECT_API_URL"]
    with temporary_settings({PREFECT_API_URL: url}):
        yield url


def checked(
    steps: dict[str, Any], tmp_path: Path, timeout: float = 30.0, *, prefect: bool = True, work_pool: str | None = None
) -> list[CheckRow]:
    """The rows of ``gpuferry check`` on ``steps`` (``Stack.check``, and the Prefect group unless ``prefect`` is
    False), which must return within ``timeout`` (+ ``SLACK_S``)."""
    path = write(tmp_path / "stack.yaml", {"local": steps})
    stack = read_stack_file(path.read_text(), str(path), tmp_path)["local"]
    started = time.monotonic()
    rows = stack.check(timeout=timeout, more=[prefect_group(work_pool, timeout)] if prefect else [])
    elapsed = time.monotonic() - started
    assert elapsed < timeout + SLACK_S, f"the check took {elapsed:.1f} s with a deadline of {timeout:.0f} s"
    return rows


def table(rows: list[CheckRow]) -> str:
    return "\n".join(f"{r.step} {r.check}: {r.status} {r.detail} | {r.fix}" for r in rows)
