"""Planted secrets through a whole retrain on the remote Slurm topology: a workload secret (a Prefect Secret
block the workload names) and the S3 store's secret key reach the job and the cluster-side store, and their
values are found nowhere else: not in any file gpuferry wrote on the cluster (scripts, logs, code, settings),
not on any process's command line while the run goes on, not in the run's Prefect logs, not in Slurm's
accounting, not in the MLflow run (params, tags, artifacts) or its model version."""

from __future__ import annotations

import hashlib
import shutil
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from blocks.specs import Resources, TrainingSpec
from flows.retrain import retrain
from tests.examples import DIABETES
from tests.stacks import remove_on_cluster, stack_env
from tests.test_pipeline_slurm import slurm_stack

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_server")]

# Checks that the job got the secret (by its hash, which is no secret), then trains: the workload's own code.
PROBE = '''import hashlib, os, runpy, sys
if hashlib.sha256(os.environ["API_TOKEN"].encode()).hexdigest() != os.environ["TOKEN_SHA256"]:
    sys.exit("API_TOKEN is not the planted secret")
print("API_TOKEN received", flush=True)
sys.argv = ["train.py"]
runpy.run_path("train.py", run_name="__main__")
'''


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


class CommandLines:
    """Every process's command line, sampled from /proc until stopped."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        self.seen.add((entry / "cmdline").read_bytes())
                    except OSError:
                        pass
            self._stop.wait(0.1)

    def stop(self) -> set[bytes]:
        self._stop.set()
        self._thread.join(30)
        return self.seen


def test_planted_secrets_reach_the_job_and_nothing_else(tmp_path: Path) -> None:
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    token = f"planted-{uuid.uuid4().hex}"
    block = f"planted-token-{uuid.uuid4().hex[:8]}"
    Secret(value=token).save(block, overwrite=True)
    planted = [token, stack_env("s3")["AWS_SECRET_ACCESS_KEY"]]
    env = stack_env("slurm")

    stack = slurm_stack("planted")
    root = stack.compute.workdir_root
    stack.save("slurm-planted-test", overwrite=True)
    lines = CommandLines()
    try:
        outcome = retrain(workload=str(_workload(tmp_path, block, token)), stack="slurm-planted-test",
                          training=TrainingSpec(model_name=f"planted-{uuid.uuid4().hex[:6]}",
                                                resources=Resources(mem_gb=1)))  # fmt: skip
        seen = lines.stop()
        assert len(seen) > 10  # the sampler saw the processes
        client = MlflowClient(tracking_uri=stack.tracking.tracking_uri)
        run = client.get_run(outcome.run_id)
        key = f"{run.data.tags['prefect.flow_run_id']}-train"
        rc, log, _ = stack.compute.run(["cat", f"{root}/{key}/job.log"])
        assert rc == 0 and "API_TOKEN received" in log, log[-3000:]  # the job had it
        assert outcome.checkpoint is not None  # and the cluster stored the model with the S3 key

        bucket, _, prefix = outcome.checkpoint.uri.removeprefix("s3://").partition("/")
        s3 = stack.storage.bucket.credentials.get_s3_client()
        for value in planted:
            raw = value.encode()
            # Command lines of every process while it ran (the worker's, SSH's, the jobs', the store's).
            assert not [c for c in seen if raw in c], "a secret on a command line"
            # Prefect's logs of the run.
            import asyncio

            async def logs() -> list[str]:
                async with get_client() as prefect:
                    found = await prefect.read_logs(log_filter=LogFilter(
                        flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run.data.tags["prefect.flow_run_id"])])))
                    return [entry.message for entry in found]

            messages = asyncio.run(logs())
            assert messages and not [m for m in messages if value in m]
            # MLflow: the run's params, tags and every artifact; the model version.
            assert not [k for k, v in {**run.data.params, **run.data.tags}.items() if value in f"{k}={v}"]
            artifacts = Path(client.download_artifacts(outcome.run_id, "", str(tmp_path / f"art-{raw[:6].hex()}")))
            files = [p for p in artifacts.rglob("*") if p.is_file()]  # the model is in the store, not here
            assert not [p for p in files if raw in p.read_bytes()]
            # The checkpoint the cluster stored (the model that will be served), every object of it.
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
            assert any(k.endswith("/MANIFEST.json") for k in keys) and any(k.endswith("/MLmodel") for k in keys), keys
            assert not [k for k in keys if raw in s3.get_object(Bucket=bucket, Key=k)["Body"].read()]
            version = outcome.model_version
            mv = client.get_model_version(version.name, version.version)
            assert value not in f"{mv.tags} {mv.description} {mv.source}"

        # Every file gpuferry wrote on the cluster (the secret files were removed when the job and the store
        # ended): grep reads the values from stdin, not from its command line.
        rc, out, err = stack.compute.run(["grep", "-rlF", "-f", "-", root], stdin="\n".join(planted).encode(),
                                         check=False)  # fmt: skip
        assert rc == 1, f"grep: rc={rc} {out} {err}"  # 1: no file holds any of them
        # Slurm's record of the job: its submit line and comment.
        import subprocess

        acct = subprocess.run(["sacct", "-n", "-P", f"--name={key}", "-S", "now-1hour", "-o",
                               "SubmitLine%500,Comment%300,WorkDir%300"], capture_output=True, text=True, check=True,
                              env={"SLURM_CONF": env["SLURM_CONF"], "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
        assert key in acct and not [v for v in planted if v in acct]
    finally:
        lines.stop()
        remove_on_cluster(stack.compute, root)
        stack.compute.close()
        Secret.delete(block)
