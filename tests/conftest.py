"""Shared fixtures: one Prefect test server and one gpuferry home per test session, and the local stacks' pieces
that several test files use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from blocks.docker_image import DockerImageBuilder
    from blocks.s3 import S3CheckpointStore


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


# ---- local stacks shared by several test files (tests/stacks.py reads their settings) ----------------


@pytest.fixture(scope="session")
def k8s() -> dict[str, str]:
    """The local Kubernetes control plane (`make k8s-up`)."""
    from tests.stacks import stack_env

    return stack_env("k8s")


@pytest.fixture
def k8s_namespace(k8s: dict[str, str]) -> Iterator[str]:
    """A namespace of the test's own on the local control plane, deleted at the end."""
    import uuid

    from pydantic import SecretStr

    from blocks.kubernetes import KubernetesCluster

    name = f"t-{uuid.uuid4().hex[:8]}"
    api = KubernetesCluster(kubeconfig=SecretStr(Path(k8s["KUBECONFIG"]).read_text()))._api()
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    api.request("POST", "/api/v1/namespaces", body=namespace)
    yield name
    api.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def workload_builder(k8s: dict[str, str]) -> DockerImageBuilder:
    """A DockerImageBuilder on the registry stack (its base image), for the example workloads' images that
    the kubelet stand-in really runs with podman (skipped when it only simulates them)."""
    if k8s.get("K8S_KUBELET_MODE") != "podman":
        message = "the kubelet stand-in runs in fake mode: `make registry-up`, then `make k8s-up` again"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from prefect_docker.credentials import DockerRegistryCredentials
    from prefect_docker.host import DockerHost

    from blocks.docker_image import DockerImageBuilder
    from tests.stacks import stack_env

    reg = stack_env("registry")
    return DockerImageBuilder(
        docker_host=DockerHost(base_url=reg["DOCKER_HOST"]),
        credentials=DockerRegistryCredentials(
            username=reg["REGISTRY_USER"], password=Path(reg["REGISTRY_PASSWORD_FILE"]).read_text().strip(),
            registry_url=f"http://{reg['REGISTRY_URL']}",
        ),
        repository="gpuferry-test/workload", build_args={"BASE_IMAGE": reg["BASE_IMAGE"]},
    )  # fmt: skip


@pytest.fixture(scope="module")
def s3_store() -> Iterator[S3CheckpointStore]:
    """An S3CheckpointStore on a bucket of its own in the s3 stack (`make s3-up`), emptied and removed after."""
    import uuid

    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    from blocks.s3 import S3CheckpointStore
    from tests.stacks import stack_env

    env = stack_env("s3")
    bucket = f"gpuferry-test-{uuid.uuid4().hex[:8]}"
    credentials = AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=env["S3_ENDPOINT_URL"]),
    )  # fmt: skip
    s3 = credentials.get_s3_client()
    s3.create_bucket(Bucket=bucket)
    yield S3CheckpointStore(bucket=S3Bucket(bucket_name=bucket, credentials=credentials))
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def s3_for_pods() -> Iterator[dict[str, str]]:
    """The s3 stack as containers (pods, Docker servers) see it: its endpoint relayed off loopback (moto listens on
    loopback, which a container on a bridge network does not share) to this machine's own address, and its
    credentials."""
    import httpx

    from tests.stacks import Relay, host_address, stack_env

    env = stack_env("s3")
    host = host_address()
    if host.startswith("127."):
        pytest.skip("this machine has no address besides loopback: containers cannot reach the s3 stack")
    endpoint = httpx.URL(env["S3_ENDPOINT_URL"])
    relay = Relay(host, (endpoint.host, endpoint.port))
    yield {
        "AWS_ENDPOINT_URL": f"http://{relay.address[0]}:{relay.address[1]}",
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": env["AWS_DEFAULT_REGION"],
    }  # fmt: skip
    relay.close()
