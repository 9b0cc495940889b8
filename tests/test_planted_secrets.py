"""Planted secrets through a whole retrain on the remote Slurm topology: a workload secret (a Prefect Secret
block the workload names) and the S3 store's secret key reach the job and the cluster-side store, and their
values are found nowhere else: not in any file gpuferry wrote on the cluster (scripts, logs, code, settings),
not on any process's command line while the run goes on, not in the run's Prefect logs, not in Slurm's
accounting, not in the MLflow run (params, tags, artifacts) or its model version."""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from blocks.specs import Resources, TrainingSpec
from flows.retrain import retrain
from tests.examples import DIABETES
from tests.planted import CommandLines, flow_run_logs, send_logs_now
from tests.stacks import mlflow_login_in_environment, remove_on_cluster, stack_env
from tests.test_pipeline_slurm import slurm_stack
from tests.test_slurm_cluster import slurm

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

# Checks that the job got the secret (by its hash, which is no secret), then trains: the workload's own code.
PROBE = """import hashlib, os, runpy, sys
if hashlib.sha256(os.environ["API_TOKEN"].encode()).hexdigest() != os.environ["TOKEN_SHA256"]:
    sys.exit("API_TOKEN is not the planted secret")
print("API_TOKEN received", flush=True)
sys.argv = ["train.py"]
runpy.run_path("train.py", run_name="__main__")
"""


def _workload(tmp_path: Path, secret_block: str, token: str) -> Path:
    """The regressor example, its training command behind the probe, with one secret."""
    work = tmp_path / "workload"
    shutil.copytree(DIABETES, work)
    (work / "probe.py").write_text(PROBE)
    definition = yaml.safe_load((work / "gpuferry.yaml").read_text())
    definition["train"]["command"] = ["python", "probe.py"]
    definition["train"]["secrets"] = {"API_TOKEN": secret_block}
    definition["train"]["env"] = {"TOKEN_SHA256": hashlib.sha256(token.encode()).hexdigest()}
    (work / "gpuferry.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))
    return work


def test_planted_secrets_reach_the_job_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret

    token = f"planted-{uuid.uuid4().hex}"
    block = f"planted-token-{uuid.uuid4().hex[:8]}"
    Secret(value=token).save(block, overwrite=True)
    planted = [token, stack_env("s3")["AWS_SECRET_ACCESS_KEY"]]
    env = stack_env("slurm")

    stack = slurm_stack("planted")
    root = stack.compute.workdir_root
    stack.save("slurm-planted-test", overwrite=True)
    send_logs_now()
    lines = CommandLines()
    try:
        outcome = retrain(
            workload=str(_workload(tmp_path, block, token)),
            stack="slurm-planted-test",
            training=TrainingSpec(model_name=f"planted-{uuid.uuid4().hex[:6]}", resources=Resources(mem_gb=1)),
        )
        seen = lines.stop()
        assert len(seen) > 10  # the sampler saw the processes
        client = stack.tracking.client
        run = client.get_run(outcome.run_id)
        key = f"{run.data.tags['prefect.flow_run_id']}-train"
        rc, log, _ = stack.compute.run(["cat", f"{root}/{key}/job.log"])
        assert rc == 0 and "API_TOKEN received" in log, log[-3000:]  # the job had it
        assert outcome.checkpoint is not None  # and the cluster stored the model with the S3 key

        # Everything the values must not be in, read once: name -> contents.
        flow_run_id = uuid.UUID(run.data.tags["prefect.flow_run_id"])

        messages = flow_run_logs(flow_run_id)
        assert messages
        bucket, _, prefix = outcome.checkpoint.uri.removeprefix("s3://").partition("/")
        s3 = stack.storage.bucket.credentials.get_s3_client()
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
        assert any(k.endswith("/MANIFEST.json") for k in keys) and any(k.endswith("/MLmodel") for k in keys), keys
        mlflow_login_in_environment(monkeypatch)  # MLflow's artifact client reads its login there only
        artifacts = Path(client.download_artifacts(outcome.run_id, "", str(tmp_path / "artifacts")))
        version = client.get_model_version(outcome.model_version.name, outcome.model_version.version)
        # Slurm's record of the job: its submit line, comment and directory.
        acct = slurm(
            env, "sacct", "-n", "-P", f"--name={key}", "-S", "now-1hour", "-o", "SubmitLine%500,Comment%300,WorkDir%300"
        )
        assert key in acct
        places: dict[str, list[bytes]] = {
            # Command lines of every process while it ran (the worker's, SSH's, the jobs', the store's).
            "a command line": list(seen),
            "the run's Prefect logs": [m.encode() for m in messages],
            "the MLflow run's params and tags": [
                f"{k}={v}".encode() for k, v in {**run.data.params, **run.data.tags}.items()
            ],
            # The model is in the store, not among the run's artifacts; whatever is there is read too.
            "the MLflow run's artifacts": [p.read_bytes() for p in artifacts.rglob("*") if p.is_file()],
            # The checkpoint the cluster stored (the model that will be served), every object of it.
            "the stored checkpoint": [s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys],
            "the model version": [f"{version.tags} {version.description} {version.source}".encode()],
            "Slurm's accounting": [acct.encode()],
        }
        for value in planted:
            for place, contents in places.items():
                assert not [c for c in contents if value.encode() in c], f"a planted secret in {place}"

        # Every file gpuferry wrote on the cluster (the secret files were removed when the job and the store
        # ended): grep reads the values from stdin, not from its command line.
        rc, out, err = stack.compute.run(
            ["grep", "-rlF", "-f", "-", root], stdin="\n".join(planted).encode(), check=False
        )
        assert rc == 1, f"grep: rc={rc} {out} {err}"  # 1: no file holds any of them
    finally:
        lines.stop()
        remove_on_cluster(stack.compute, root)
        stack.compute.close()
        Secret.delete(block)
