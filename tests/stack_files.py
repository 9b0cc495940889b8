"""A stack file for the local stacks (`make <stack>-up`), written from their env files as a user would write
one for their own cluster: secrets as references to files and environment variables, never values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.stacks import stack_env

# The variables the file's {env: ...} references read (the test sets them from the s3 stack's env file).
S3_SECRET_ENV = "GPUFERRY_TEST_S3_SECRET"


def local_stack(bucket: str, namespace: str = "default", workdir_root: str | None = None) -> dict[str, Any]:
    """The steps of a Slurm + registry + S3 + MLflow + Kubernetes stack on the local stacks."""
    slurm, registry, s3, mlflow, k8s = (stack_env(n) for n in ("slurm", "registry", "s3", "mlflow", "k8s"))
    return {
        "provider": {"type": "ClusterManaged", "cluster_name": "local"},
        "images": {
            "type": "DockerImageBuilder",
            "repository": "gpuferry-test/stack-file",
            "docker_host": {"base_url": registry["DOCKER_HOST"]},
            "credentials": {
                "registry_url": f"http://{registry['REGISTRY_URL']}",
                "username": registry["REGISTRY_USER"],
                "password": {"file": registry["REGISTRY_PASSWORD_FILE"]},
            },
            "build_args": {"BASE_IMAGE": registry["BASE_IMAGE"]},
        },
        "compute": {
            "type": "SlurmCluster",
            "host": slurm["SLURM_SSH_HOST"],
            "port": int(slurm["SLURM_SSH_PORT"]),
            "credentials": {
                "user": slurm["SLURM_SSH_USER"],
                "private_key": {"file": slurm["SLURM_SSH_KEY"]},
                "known_hosts": {"file": slurm["SLURM_KNOWN_HOSTS"]},
            },
            "slurm_conf": slurm["SLURM_CONF"],
            "partition": slurm["SLURM_PARTITION"],
            "account": slurm["SLURM_ACCOUNT"],
            # The cluster's own interpreter and filesystem: neither exists on this machine, as for a remote cluster.
            "python": slurm["SLURM_CLUSTER_PYTHON"],
            "workdir_root": workdir_root or f"{slurm['SLURM_CLUSTER_DIR']}/stack-file",
            "podman_gpu_mode": "env",  # the stack's GPUs are stand-in character devices
            "container_runtime_env": {
                k: registry[k] for k in ("CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF")
            },
            "registry_credentials": {
                "registry_url": f"http://{registry['REGISTRY_URL']}",
                "username": registry["REGISTRY_USER"],
                "password": {"file": registry["REGISTRY_PASSWORD_FILE"]},
            },
        },
        "storage": {
            "type": "S3CheckpointStore",
            "bucket": {
                "bucket_name": bucket,
                "credentials": {
                    "aws_access_key_id": s3["AWS_ACCESS_KEY_ID"],
                    "aws_secret_access_key": {"env": S3_SECRET_ENV},
                    "region_name": s3["AWS_DEFAULT_REGION"],
                    "aws_client_parameters": {"endpoint_url": s3["S3_ENDPOINT_URL"]},
                },
            },
        },
        "tracking": {
            "tracking_uri": mlflow["MLFLOW_TRACKING_URI"],
            "username": mlflow["MLFLOW_TRACKING_USERNAME"],
            "password": {"file": mlflow["MLFLOW_PASSWORD_FILE"]},
        },
        "serving": {"type": "KubernetesCluster", "kubeconfig": {"file": k8s["KUBECONFIG"]}, "namespace": namespace},
    }


def write(path: Path, stacks: dict[str, dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"stacks": stacks}, sort_keys=False))
    return path
