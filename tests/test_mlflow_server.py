"""The tracking block and tasks against a real MLflow server (`make mlflow-up`: PostgreSQL + S3 artifacts, a login
required: MLflow's basic auth). The tests log in as the stack's tests user (tests/stacks.py: mlflow_server)."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from pathlib import Path

import boto3
import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from pydantic import SecretStr

from blocks.base.storage import MANIFEST
from blocks.errors import ConfigurationError
from blocks.records import CheckpointRef
from blocks.specs import PromotionPolicy
from blocks.storage.s3 import S3CheckpointStore
from blocks.tracking.mlflow import MlflowTracking
from runtime.contract import manifest_bytes
from tasks.track import log_run, register_model
from tests.stacks import mlflow_login_in_environment, mlflow_server, stack_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mlflow_env() -> dict[str, str]:
    return stack_env("mlflow")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "final"
    src.mkdir()
    (src / "model.pt").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text('{"hidden": 128}')
    return src


def test_run_and_version_record_the_checkpoint(
    mlflow_env: dict[str, str], s3_store: S3CheckpointStore, checkpoint: Path, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    ref = s3_store.put(checkpoint, f"digits/{tag}")
    # artifact_location=None: the server's own artifact root (the S3 stack), not a local directory.
    tracking = mlflow_server()
    tags = {"prefect.flow_run_id": f"test-{tag}"}
    run_id = tracking.start_run(f"gpuferry-test-{tag}", f"retrain-{tag}", tags)
    assert tracking.start_run(f"gpuferry-test-{tag}", f"retrain-{tag}", tags) == run_id  # same flow run, same run
    # What the flow records on the run.
    tracking.log(
        run_id,
        metrics={"val_accuracy": 0.93},
        tags={"checkpoint_uri": ref.uri, "checkpoint_sha256": ref.sha256, "checkpoint_size_bytes": str(ref.size_bytes)},
    )
    model = f"digits-{tag}"
    version = tracking.register(model, run_id, ref, "val_accuracy", 0.93)
    assert tracking.register(model, run_id, ref, "val_accuracy", 0.93) == version  # idempotent per run
    tracking.set_alias(model, "champion", version)
    tracking.end_run(run_id)

    run = tracking.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["checkpoint_uri"] == ref.uri == f"s3://{s3_store.bucket.bucket_name}/checkpoints/digits/{tag}"
    assert run.data.tags["checkpoint_sha256"] == ref.sha256
    assert run.data.tags["checkpoint_size_bytes"] == str(ref.size_bytes) == str(300_000 + 15)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # no second copy of the weights was made
    mv = tracking.client.get_model_version(model, version)
    assert (mv.source, mv.run_id) == (ref.uri, run_id)
    assert mv.tags["checkpoint_sha256"] == ref.sha256
    assert mv.tags["checkpoint_size_bytes"] == str(ref.size_bytes)
    assert tracking.version_by_alias(model, "champion") == version
    assert tracking.version_metric(model, version, "val_accuracy") == 0.93
    assert tracking.run_url(run_id).startswith(mlflow_env["MLFLOW_TRACKING_URI"] + "/#/experiments/")

    # The version serves from its source: fetched by that URI, every file verified, the same manifest.
    source = tracking.model_source(model, version)
    out = s3_store.get(source, tmp_path / "served")
    assert (out / "model.pt").read_bytes() == (checkpoint / "model.pt").read_bytes()
    assert hashlib.sha256(manifest_bytes(s3_store.read_manifest(source))).hexdigest() == mv.tags["checkpoint_sha256"]
    assert not (out / MANIFEST).exists()

    # The server's database outlives the test session: leave nothing behind.
    tracking.client.delete_registered_model(model)
    tracking.client.delete_experiment(run.info.experiment_id)


def test_artifacts_go_to_the_s3_stack(
    mlflow_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server keeps run artifacts in the s3 stack's bucket (RGW checks the server's keys and signatures)."""
    mlflow_login_in_environment(monkeypatch)  # MLflow's artifact client takes its login from there only
    tag = uuid.uuid4().hex[:8]
    tracking = mlflow_server()
    run_id = tracking.start_run(f"gpuferry-test-{tag}", f"artifacts-{tag}", {"prefect.flow_run_id": f"test-{tag}"})
    notes = tmp_path / "notes.txt"
    notes.write_text(f"run {tag}")
    tracking.client.log_artifact(run_id, str(notes), artifact_path="notes")
    experiment_id = tracking.client.get_run(run_id).info.experiment_id
    try:
        s3_env = stack_env("s3")
        s3 = boto3.client(
            "s3",
            endpoint_url=s3_env["S3_ENDPOINT_URL"],
            aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
            region_name=s3_env["AWS_DEFAULT_REGION"],
        )
        bucket, _, prefix = mlflow_env["MLFLOW_ARTIFACTS_DESTINATION"].removeprefix("s3://").partition("/")
        key = f"{prefix}{experiment_id}/{run_id}/artifacts/notes/notes.txt"
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == f"run {tag}".encode()
        back = tracking.client.download_artifacts(run_id, "notes/notes.txt", str(tmp_path / "back"))
        assert Path(back).read_text() == f"run {tag}"
    finally:
        tracking.end_run(run_id)
        tracking.client.delete_experiment(experiment_id)


def test_the_server_requires_a_login(mlflow_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An anonymous request and a wrong password are refused (401); /health stays open; the block with the
    stack's login is let in."""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)  # only the block's login counts
    uri = mlflow_env["MLFLOW_TRACKING_URI"]
    search = f"{uri}/api/2.0/mlflow/experiments/search"
    user, password = mlflow_env["MLFLOW_TRACKING_USERNAME"], mlflow_env["MLFLOW_TRACKING_PASSWORD"]
    assert httpx.get(f"{uri}/health", timeout=30).text == "OK"
    assert httpx.get(search, params={"max_results": 1}, timeout=30).status_code == 401
    assert httpx.get(search, params={"max_results": 1}, auth=(user, f"{password}-wrong"), timeout=30).status_code == 401
    assert httpx.get(search, params={"max_results": 1}, auth=(user, password), timeout=30).status_code == 200

    with pytest.raises(ConfigurationError, match=r"requires a login \(HTTP 401\) and the tracking block has none"):
        MlflowTracking(tracking_uri=uri, artifact_location=None).experiment_id("gpuferry-test-anonymous")
    wrong = mlflow_server(password=SecretStr(f"{password}-wrong"))
    with pytest.raises(ConfigurationError, match=rf"refused the login of tracking.username='{user}' and its password"):
        wrong.experiment_id("gpuferry-test-wrong-password")
    assert mlflow_server().client.search_experiments(max_results=1) is not None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("prefect_server")
def test_server_down_is_retried_then_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow's own HTTP retries would spend minutes on a refused connection; the task's retries decide.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    url = f"http://127.0.0.1:{_closed_port()}"
    down = MlflowTracking(tracking_uri=url, artifact_location=None)
    ref = CheckpointRef(uri="s3://b/checkpoints/m/r", sha256="0" * 64, size_bytes=1, files=1)
    fast_log = log_run.with_options(retries=2, retry_delay_seconds=[0.05, 0.05], retry_jitter_factor=None)
    fast_register = register_model.with_options(retries=1, retry_delay_seconds=[0.05], retry_jitter_factor=None)

    @flow
    def tracked() -> tuple:
        logged = fast_log(down, "0" * 32, metrics={"val_accuracy": 0.9}, return_state=True)
        policy = PromotionPolicy(metric="val_accuracy", direction="maximize")
        registered = fast_register(down, "0" * 32, "m", ref, policy, 0.9, return_state=True)
        return logged, registered

    logged, registered = tracked()
    with get_client(sync_client=True) as client:
        for state, attempts in ((logged, 3), (registered, 2)):
            assert state.is_failed()
            assert client.read_task_run(state.state_details.task_run_id).run_count == attempts
            error = state.result(raise_on_failure=False)
            assert f"API request to {url}/api/2.0/mlflow/" in str(error)
            assert "Connection refused" in str(error)
