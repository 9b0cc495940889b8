"""Shared fixtures: one Prefect test server and one gpuferry home per test session, and the local stacks' pieces
that several test files use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from blocks.docker.image import DockerImageBuilder
    from blocks.slurm.cluster import SlurmCluster
    from blocks.storage.s3 import S3CheckpointStore


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
    """A namespace of the test's own on the local cluster, deleted at the end. It holds the image pull secret
    ``tests.k8s_node.PULL_SECRET`` with the registry stack's credentials when the node can reach that registry."""
    import uuid

    from pydantic import SecretStr

    from blocks.kubernetes.cluster import KubernetesCluster
    from tests.k8s_node import pull_secret
    from tests.stacks import stack_env

    name = f"t-{uuid.uuid4().hex[:8]}"
    api = KubernetesCluster(kubeconfig=SecretStr(Path(k8s["KUBECONFIG"]).read_text()))._api()
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    api.request("POST", "/api/v1/namespaces", body=namespace)
    if k8s.get("K8S_NODE_REGISTRY"):
        api.request("POST", f"/api/v1/namespaces/{name}/secrets", body=pull_secret(stack_env("registry")))
    yield name
    api.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def workload_builder(k8s: dict[str, str]) -> DockerImageBuilder:
    """A DockerImageBuilder on the registry stack (its base image), for the example workloads' images, which the
    k8s stack's node pulls from the registry (it must have been up when the k8s stack came up)."""
    if not k8s.get("K8S_NODE_REGISTRY"):
        message = "the k8s node has no relay to the registry stack: `make registry-up`, then `make k8s-up` again"
        if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from prefect_docker.host import DockerHost

    from blocks.docker.image import DockerImageBuilder
    from tests.stacks import registry_login, stack_env

    reg = stack_env("registry")
    return DockerImageBuilder(
        docker_host=DockerHost(base_url=reg["DOCKER_HOST"]),
        credentials=registry_login(),
        repository="gpuferry-test/workload",
        build_args={"BASE_IMAGE": reg["BASE_IMAGE"]},
    )


@pytest.fixture(scope="session")
def workload_image(workload_builder: DockerImageBuilder) -> str:
    """The workload image, built and pushed once per session: its reference by digest."""
    from blocks.workload.source import load_workload
    from tests.examples import DIGITS

    reference = workload_builder.build(load_workload(str(DIGITS))).reference
    assert reference and "@sha256:" in reference
    return reference


@pytest.fixture(scope="module")
def s3_store() -> Iterator[S3CheckpointStore]:
    """An S3CheckpointStore on a bucket of its own in the s3 stack (`make s3-up`), emptied and removed after."""
    import uuid

    from tests.stacks import s3_store as store_on

    store = store_on(f"gpuferry-test-{uuid.uuid4().hex[:8]}")
    yield store
    s3 = store.client()
    bucket = store.bucket.bucket_name
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def s3_for_containers() -> Iterator[dict[str, str]]:
    """The s3 stack as containers on a bridge network (Docker servers) see it: its endpoint relayed off loopback
    (the s3 stack listens on loopback, which such a container does not share) to this machine's own address,
    and its credentials."""
    from tests.stacks import Relay, host_address, s3_seen_from, s3_target

    host = host_address()
    if host.startswith("127."):
        pytest.skip("this machine has no address besides loopback: containers cannot reach the s3 stack")
    relay = Relay(host, s3_target())
    yield s3_seen_from(relay)
    relay.close()


@pytest.fixture(scope="module")
def s3_for_pods(k8s: dict[str, str]) -> Iterator[dict[str, str]]:
    """The s3 stack as the k8s stack's pods see it: its endpoint relayed from inside the node's network
    namespace (the node's address) to this machine's loopback, and its credentials."""
    from tests.k8s_node import NodeRelay
    from tests.stacks import s3_seen_from, s3_target

    relay = NodeRelay(k8s["K8S_NODE_NETNS"], k8s["K8S_NODE_IP"], s3_target())
    yield s3_seen_from(relay)
    relay.close()


@pytest.fixture
def slurm_in_images() -> Iterator[SlurmCluster]:
    """The slurm stack as a stack file would declare it for jobs in the workload's image: over SSH, each job
    pulling the image with the registry stack's login and running it with podman (the stack's nodes have
    podman, and stand-in GPUs passed as CUDA_VISIBLE_DEVICES), in a job directory of the test's own on the
    cluster's own filesystem (a path this machine does not have)."""
    from tests.stacks import cluster_dir, remove_on_cluster, slurm_for_images

    workdir_root = cluster_dir("in-images")
    cluster = slurm_for_images(workdir_root)
    yield cluster
    remove_on_cluster(cluster, workdir_root)
    cluster.close()
