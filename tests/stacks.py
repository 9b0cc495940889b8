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


def s3_store(bucket: str, create: bool = True):  # type: ignore[no-untyped-def]
    """An S3CheckpointStore on ``bucket`` of the s3 stack (created when missing)."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    from blocks.s3 import S3CheckpointStore

    env = stack_env("s3")
    credentials = AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=env["S3_ENDPOINT_URL"]),
    )  # fmt: skip
    if create:
        s3 = credentials.get_s3_client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
    return S3CheckpointStore(bucket=S3Bucket(bucket_name=bucket, credentials=credentials))
