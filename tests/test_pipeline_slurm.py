"""The retrain pipeline with training on the real local Slurm cluster as a remote cluster: submitted over SSH,
the job directories on the cluster's own filesystem (a path this machine does not have), the cluster's own
Python, the trained model stored by the cluster itself into the s3 stack, the job logging to the mlflow
stack's server over the network.

The stack is saved as a Prefect block and the flow is given its name, as a user would from the UI.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from blocks.base.provider import ClusterManaged
from blocks.specs import Resources, TrainingSpec
from blocks.stack import Stack
from flows.retrain import retrain
from tests.examples import DIGITS
from tests.stacks import mlflow_server, remote_slurm, remove_on_cluster, s3_store, stack_env

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parent.parent


# Where the Slurm tests' trained models go: the cluster stores them itself (the orchestrator does not read its
# filesystem), so into a store both reach: the s3 stack. One bucket for them all; keys carry the run's id.
TEST_BUCKET = "gpuferry-test-slurm"


def slurm_stack(name: str) -> Stack:
    stack = Stack.embedded()
    stack.storage = s3_store(TEST_BUCKET)
    stack.tracking = mlflow_server()
    stack.provider = ClusterManaged(cluster_name="gpuferry-test")  # Slurm owns the nodes and their GPUs
    stack.compute = remote_slurm(name)
    return stack


def test_retrain_trains_on_a_remote_slurm_cluster() -> None:
    env = stack_env("slurm")
    stack = slurm_stack("pipeline")
    root = stack.compute.workdir_root
    stack.save("slurm-pipeline-test", overwrite=True)
    try:
        outcome = retrain(
            workload=str(DIGITS),
            training=TrainingSpec(
                model_name=f"digits-slurm-{uuid.uuid4().hex[:6]}",
                hyperparameters={"epochs": 3},
                resources=Resources(mem_gb=2, gpus_per_node=1),
            ),
            stack="slurm-pipeline-test",
            force_deploy=True,
        )
        run = stack.tracking.client.get_run(outcome.run_id)
        assert run.data.tags["backend.compute"] == "gpuferry-slurm-cluster"
        assert run.data.metrics["val_accuracy"] == pytest.approx(outcome.model_version.value)
        assert run.data.metrics["cpu_hours"] > 0
        assert run.data.metrics["gpu_hours"] > 0  # gres/gpu × elapsed, from sacct
        # The job really went through Slurm: sacct knows it by the pipeline's key.
        sacct = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-S", "now-1hour", "-o", "JobID,JobName%100,State"],
            env={"SLURM_CONF": env["SLURM_CONF"], "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        key = f"{run.data.tags['prefect.flow_run_id']}-train"
        mine = [line.split("|") for line in sacct.splitlines() if line.split("|")[1:2] == [key]]
        assert [state for _, _, state in mine] == ["COMPLETED"], sacct
        # The job ran with the cluster's interpreter, in a directory only the cluster has; the checkpoint came
        # to the store from there.
        workdir = f"{root}/{key}"
        assert not Path(workdir).exists()
        rc, out, _ = stack.compute.run(["cat", f"{workdir}/job.log"])
        assert rc == 0 and "finished" in out, out[-2000:]
        assert outcome.checkpoint is not None and outcome.checkpoint.uri.startswith(f"s3://{TEST_BUCKET}/")
        rc, script, _ = stack.compute.run(["cat", f"{workdir}/job.sbatch"])
        assert env["SLURM_CLUSTER_PYTHON"] in script
        assert outcome.deployed and outcome.endpoint is not None
        Stack.embedded().serving.undeploy("digits")
    finally:
        remove_on_cluster(stack.compute, root)
        stack.compute.close()
