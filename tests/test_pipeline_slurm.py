"""The retrain pipeline with training on the real local Slurm cluster, submitted over SSH.

The stack is saved as a Prefect block and the flow is given its name, as a user would from the UI.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from pydantic import SecretStr

from blocks.provision import ClusterManaged
from blocks.slurm import SlurmCluster
from blocks.specs import Resources, TrainingSpec
from blocks.stack import Stack
from flows.retrain import retrain
from tests.examples import DIGITS
from tests.stacks import s3_store, stack_env

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parent.parent


# Where the Slurm tests' trained models go: the cluster stores them itself (the orchestrator does not read its
# filesystem), so into a store both reach: the s3 stack. One bucket for them all; keys carry the run's id.
TEST_BUCKET = "gpuferry-test-slurm"


def slurm_stack(env: dict[str, str]) -> Stack:
    stack = Stack.embedded()
    stack.storage = s3_store(TEST_BUCKET)
    stack.provider = ClusterManaged(cluster_name="gpuferry-test")  # Slurm owns the nodes and their GPUs
    stack.compute = SlurmCluster(
        host=env["SLURM_SSH_HOST"], port=int(env["SLURM_SSH_PORT"]), user=env["SLURM_SSH_USER"],
        private_key=SecretStr(Path(env["SLURM_SSH_KEY"]).read_text()),
        known_hosts=Path(env["SLURM_KNOWN_HOSTS"]).read_text(), slurm_conf=env["SLURM_CONF"],
        workdir_root=str(Path(env["SLURM_SHARED_DIR"]) / f"pipeline-{uuid.uuid4().hex[:8]}"),
        partition=env["SLURM_PARTITION"], python=sys.executable,
    )  # fmt: skip
    return stack


def test_retrain_trains_on_slurm() -> None:
    env = stack_env("slurm")
    slurm_stack(env).save("slurm-pipeline-test", overwrite=True)
    outcome = retrain(
        workload=str(DIGITS),
        training=TrainingSpec(
            model_name="digits-slurm", hyperparameters={"epochs": 3}, resources=Resources(mem_gb=2, gpus_per_node=1)
        ),
        stack="slurm-pipeline-test",
        force_deploy=True,
    )
    run = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri).get_run(outcome.run_id)
    assert run.data.tags["backend.compute"] == "gpuferry-slurm-cluster"
    assert run.data.metrics["val_accuracy"] == pytest.approx(outcome.model_version.value)
    assert run.data.metrics["cpu_hours"] > 0
    assert run.data.metrics["gpu_hours"] > 0  # gres/gpu × elapsed, from sacct
    # The job really went through Slurm: sacct knows it by the pipeline's key.
    sacct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", "now-1hour", "-o", "JobID,JobName%100,State"],
        env={"SLURM_CONF": env["SLURM_CONF"], "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    key = f"{run.data.tags['prefect.flow_run_id']}-train"
    mine = [line.split("|") for line in sacct.splitlines() if line.split("|")[1:2] == [key]]
    assert [state for _, _, state in mine] == ["COMPLETED"], sacct
    assert outcome.deployed and outcome.endpoint is not None
    Stack.embedded().serving.undeploy("digits")
