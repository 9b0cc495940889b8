"""The whole retrain pipeline on the embedded stack, under one Prefect test server, for both bundled examples.

The digits MLP (PyTorch, maximising accuracy), three runs as a team would see them: a weak first model becomes
champion and is served; a better one replaces it (the old server process is gone); a worse one is registered
but neither promoted nor deployed. The diabetes regressor (scikit-learn, minimising RMSE) through exactly the
same code: a bad model does not replace a good one. Then what must fail does, before anything is wasted: a
deploy whose smoke request the model refuses (the flow fails and MLflow says why), hyperparameters the
workload's schema refuses (nothing runs), a job that writes no MLflow model (nothing is registered), and a
serving backend that cannot serve (nothing trains).
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from mlflow import MlflowClient
from prefect.artifacts import Artifact

from blocks.base.mlflow_model import NoModel
from blocks.base.proc import alive
from blocks.base.storage import MANIFEST, local_path, verify_checkpoint
from blocks.errors import ConfigurationError, DeployFailed
from blocks.local.serving import LocalServing
from blocks.records import PipelineResult
from blocks.specs import ServingSpec, TrainingSpec
from blocks.stack import Stack
from flows.deploy_model import deploy_model
from flows.retrain import retrain
from tests.examples import DIABETES, DIGITS, example_module

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("prefect_server")]

# Measured on the held-out test split (269 digits) with these settings: 0.95-0.97 over seeds 0-4.
MIN_TEST_ACCURACY = 0.92


def digits(**hyperparameters: float) -> TrainingSpec:
    return TrainingSpec(model_name="digits-e2e", hyperparameters=hyperparameters, checkpoint_every=20)


@pytest.fixture(scope="module")
def runs() -> dict[str, PipelineResult | dict]:
    stack = Stack.embedded()
    out: dict[str, PipelineResult | dict] = {}
    out["weak"] = retrain(workload=str(DIGITS), training=digits(epochs=1, lr=0.01))
    out["weak_server"] = stack.serving.current("digits") or {}
    out["good"] = retrain(workload=str(DIGITS), training=digits(epochs=15, lr=0.05))
    out["good_server"] = stack.serving.current("digits") or {}
    out["worse"] = retrain(workload=str(DIGITS), training=digits(epochs=1, lr=0.005))
    out["after_worse_server"] = stack.serving.current("digits") or {}
    yield out
    stack.serving.undeploy("digits")


def test_champion_alias_follows_the_better_model(runs: dict) -> None:
    weak, good = runs["weak"], runs["good"]
    assert weak.model_version.promoted and weak.deployed
    assert good.model_version.promoted and good.deployed
    assert good.model_version.value > weak.model_version.value
    assert good.model_version.metric == "val_accuracy"  # the workload's promotion metric
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    champion = client.get_model_version_by_alias("digits-e2e", "champion")
    assert str(champion.version) == good.model_version.version
    assert champion.source == good.checkpoint.uri


def test_worse_model_registered_but_not_promoted_nor_deployed(runs: dict) -> None:
    worse, good = runs["worse"], runs["good"]
    assert worse.model_version.value < good.model_version.value
    assert not worse.model_version.promoted and not worse.deployed and worse.endpoint is None
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    version = client.get_model_version("digits-e2e", worse.model_version.version)
    assert version.tags["promotion"] == "not promoted"
    # Still serving the champion, from the same process.
    assert runs["after_worse_server"]["version"] == good.model_version.version
    assert runs["after_worse_server"]["pid"] == runs["good_server"]["pid"]


def test_the_stored_model_is_the_mlflow_model_with_its_manifest(runs: dict) -> None:
    good = runs["good"]
    root = local_path(good.checkpoint.uri)
    assert hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest() == good.checkpoint.sha256
    assert verify_checkpoint(good.checkpoint.uri) == good.checkpoint.sha256  # every file re-hashed
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    run = client.get_run(good.run_id)
    assert run.data.tags["checkpoint_sha256"] == good.checkpoint.sha256
    assert run.data.tags["checkpoint_uri"] == good.checkpoint.uri
    assert run.data.tags["mlflow_model.flavors"] == "python_function,pytorch"
    version = client.get_model_version("digits-e2e", good.model_version.version)
    assert version.tags["checkpoint_sha256"] == good.checkpoint.sha256
    assert {"MLmodel", "serving_input_example.json", MANIFEST} <= {p.name for p in root.iterdir()}
    assert Path(root).parent.name == "digits-e2e"
    # Plain MLflow loads the registered version: the stored checkpoint is an MLflow model.
    import mlflow.pyfunc

    model = mlflow.pyfunc.load_model(good.checkpoint.uri)
    assert np.asarray(model.predict(np.zeros((3, 64), dtype=np.float32))).shape == (3, 10)


def test_run_records_params_metrics_the_workload_and_its_code(runs: dict) -> None:
    good = runs["good"]
    run = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri).get_run(good.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "15" and run.data.params["optimizer"] == "sgd"  # a schema default
    assert run.data.params["resources.nodes"] == "1"
    assert run.data.metrics["val_accuracy"] == pytest.approx(good.model_version.value)
    tags = run.data.tags
    assert tags["backend.compute"] == "gpuferry-local-processes"
    assert tags["image"].startswith("no image: runs from the current environment")
    assert tags["gpuferry.workload"] == "digits-mlp" and tags["gpuferry.workload.source"] == str(DIGITS)
    assert len(tags["gpuferry.workload.code_sha256"]) == 64 and tags["gpuferry.workload.commit"] != "none"


def test_deploy_outcome_recorded_on_the_run_and_the_version(runs: dict) -> None:
    good, worse = runs["good"], runs["worse"]
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    for tags in (
        client.get_run(good.run_id).data.tags,
        client.get_model_version("digits-e2e", good.model_version.version).tags,
    ):
        assert tags["deploy.status"] == "deployed"
        assert tags["deploy.version"] == good.model_version.version
        assert tags["deploy.endpoint"] == runs["good_server"]["url"]
        assert tags["deploy.previous_version"] == runs["weak"].model_version.version
        assert tags["deploy.backend"] == "gpuferry-local-serving"
        assert not any(k in tags for k in ("deploy.reason", "deploy.rolled_back_to"))
    version_tags = client.get_model_version("digits-e2e", good.model_version.version).tags
    assert version_tags["gpuferry.service"] == "digits"  # the workload's service name, recorded for deploy-model
    # Not deployed: nothing recorded.
    assert not any(k.startswith("deploy.") for k in client.get_run(worse.run_id).data.tags)


def test_endpoint_classifies_held_out_digits(runs: dict) -> None:
    server = runs["good_server"]
    x_test, y_test = example_module(DIGITS, "data").load_digits_split()["test"]
    response = httpx.post(f"{server['url']}/invocations", json={"inputs": x_test.tolist()}, timeout=60)
    assert response.status_code == 200, response.text
    predicted = np.asarray(response.json()["predictions"]).argmax(axis=1)
    assert (predicted == y_test).mean() >= MIN_TEST_ACCURACY


def test_previous_server_gone_after_new_version_ready(runs: dict) -> None:
    weak_server, good_server = runs["weak_server"], runs["good_server"]
    assert weak_server["version"] == runs["weak"].model_version.version
    assert good_server["version"] == runs["good"].model_version.version
    assert weak_server["pid"] != good_server["pid"]
    assert not alive(weak_server["pid"], weak_server["pid_start"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{weak_server['url']}/healthz", timeout=5)


def test_artifacts_written(runs: dict) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    assert {"retrain-summary", "final-metrics", "training-progress", "node-inventory"} <= keys


def test_the_regressor_runs_through_the_same_paths_and_minimises_rmse() -> None:
    stack = Stack.embedded()
    try:
        good = retrain(
            workload=str(DIABETES), training=TrainingSpec(model_name="diabetes-e2e", hyperparameters={"alpha": 0.01})
        )
        bad = retrain(
            workload=str(DIABETES), training=TrainingSpec(model_name="diabetes-e2e", hyperparameters={"alpha": 50.0})
        )
        assert good.model_version.metric == "val_rmse" and good.model_version.promoted and good.deployed
        assert bad.model_version.value > good.model_version.value  # a larger RMSE: worse
        assert not bad.model_version.promoted and not bad.deployed
        server = stack.serving.current("diabetes")
        assert server is not None and server["version"] == good.model_version.version
        x = example_module(DIABETES, "train").load_diabetes(as_frame=True).data.head(5)
        body = {"dataframe_split": {"columns": list(x.columns), "data": x.values.tolist()}}
        response = httpx.post(f"{server['url']}/invocations", json=body, timeout=60)
        assert response.status_code == 200 and len(response.json()["predictions"]) == 5
        missing = {"dataframe_split": {"columns": list(x.columns)[1:], "data": x.values[:, 1:].tolist()}}
        refused = httpx.post(f"{server['url']}/invocations", json=missing, timeout=60)
        assert refused.status_code == 422 and "age" in refused.text  # the column the signature wants
        assert stack.serving.current("digits-e2e") is None  # two models, two services
    finally:
        stack.serving.undeploy("diabetes")


def test_failed_deploy_fails_the_flow_and_mlflow_says_why_then_deploy_model_serves_it() -> None:
    # The smoke request sends 3 features where the model takes 64: the new server answers 422.
    serving = ServingSpec(service_name="digits-refused", smoke_request={"inputs": [[0.0, 1.0, 2.0]]})
    with pytest.raises(DeployFailed, match="smoke test: /invocations answered 422"):
        retrain(
            workload=str(DIGITS),
            training=TrainingSpec(model_name="digits-e2e-refused", hyperparameters={"epochs": 1}),
            serving=serving,
            force_deploy=True,
        )
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    (version,) = client.search_model_versions("name = 'digits-e2e-refused'")
    run = client.get_run(version.run_id)
    assert run.info.status == "FAILED"
    for tags in (run.data.tags, version.tags):
        assert tags["deploy.status"] == "failed"
        assert tags["deploy.version"] == tags["deploy.failed_version"] == str(version.version)
        assert tags["deploy.reason"].startswith("DeployFailed: smoke test: /invocations answered 422")
        assert "422" in tags["deploy.message"] and "deploy.endpoint" not in tags
    assert Stack.embedded().serving.current("digits-refused") is None  # nothing serves the refused version
    artifact = Artifact.get("deploy-digits-refused")  # the newest of that key
    assert artifact and "**digits-e2e-refused v1 not deployed**" in str(artifact.data)

    # deploy-model serves the same version with its own input example as the smoke request: the record is
    # replaced, on the version and on its source run (deploy-model has no run of its own), and the failure's
    # fields go.
    endpoint = deploy_model(
        model_name="digits-e2e-refused",
        version=str(version.version),
        serving=ServingSpec(service_name="digits-refused"),
    )
    try:
        for tags in (
            client.get_run(version.run_id).data.tags,
            client.get_model_version("digits-e2e-refused", version.version).tags,
        ):
            assert tags["deploy.status"] == "deployed" and tags["deploy.endpoint"] == endpoint.url
            assert not any(k in tags for k in ("deploy.reason", "deploy.message", "deploy.failed_version"))
    finally:
        Stack.embedded().serving.undeploy("digits-refused")


def test_hyperparameters_the_schema_refuses_stop_the_run_before_anything_runs() -> None:
    experiment = f"schema-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError) as info:
        retrain(
            workload=str(DIGITS), training=TrainingSpec(experiment=experiment, hyperparameters={"lr": 0, "epochz": 3})
        )
    message = str(info.value)
    assert "hyperparameters.lr: 0 is less than or equal to the minimum of 0" in message
    assert "hyperparameters.epochz: not a declared hyperparameter; valid: epochs, lr, batch_size" in message
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    assert client.get_experiment_by_name(experiment) is None  # no run was started


def test_a_job_that_writes_no_mlflow_model_registers_nothing(tmp_path: Path) -> None:
    (tmp_path / "gpuferry.yaml").write_text(
        "name: no-model-e2e\ntrain: {command: [python, train.py]}\npromotion: {metric: score}\n"
    )
    (tmp_path / "train.py").write_text(
        "import os, pathlib, mlflow\n"
        "with mlflow.start_run(): mlflow.log_metric('score', 1.0)\n"
        "final = pathlib.Path(os.environ['CHECKPOINT_DIR'], 'final'); final.mkdir(parents=True)\n"
        "(final / 'weights.bin').write_bytes(b'not an MLflow model')\n"
    )
    with pytest.raises(NoModel, match=r"holds no MLflow model \(no MLmodel file; found: weights.bin\): save an MLflow"):
        retrain(workload=str(tmp_path))
    client = MlflowClient(tracking_uri=Stack.embedded().tracking.tracking_uri)
    assert client.search_model_versions("name = 'no-model-e2e'") == []
    (run,) = client.search_runs([client.get_experiment_by_name("no-model-e2e").experiment_id])
    assert run.info.status == "FAILED"


def test_serving_preflight_stops_the_run_before_anything_trains() -> None:
    name = f"stack-bad-serving-{uuid.uuid4().hex[:8]}"
    stack = Stack.embedded()
    stack.serving = LocalServing(python="/nonexistent/bin/python3")
    stack.save(name)
    experiment = f"preflight-{uuid.uuid4().hex[:8]}"
    jobs = Path(stack.compute.job_workdir("x")).parent
    before = set(jobs.iterdir()) if jobs.exists() else set()
    with pytest.raises(ConfigurationError, match="python='/nonexistent/bin/python3': no such executable"):
        retrain(
            workload=str(DIGITS),
            training=TrainingSpec(model_name="digits-e2e-preflight", experiment=experiment),
            stack=name,
        )
    client = MlflowClient(tracking_uri=stack.tracking.tracking_uri)
    assert client.get_experiment_by_name(experiment) is None  # no run was started
    assert (set(jobs.iterdir()) if jobs.exists() else set()) == before  # no job was submitted


def test_a_workload_from_a_git_url_trains_the_commit_its_ref_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of ``git+file://REPO@TAG#subdirectory=PATH`` trains the tagged commit's files, not the branch's newer
    ones, and the MLflow run and the registered version say which commit and which code archive it was."""
    import shutil
    import subprocess

    from blocks.workload.source import code_archive

    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "models"
    shutil.copytree(DIABETES, repo / "regressors" / "diabetes", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "regressors" / "diabetes" / ".settings").mkdir()  # a hidden file the commit holds is part of the code
    (repo / "regressors" / "diabetes" / ".settings" / "notes.txt").write_text("committed\n")
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "PATH": "/usr/bin:/bin",
    }

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
        ).stdout.strip()

    git("init", "-q", "-b", "main")
    git("add", ".")
    git("commit", "-q", "-m", "the regressor")
    tagged = git("rev-parse", "HEAD")
    git("tag", "v1")
    expected_code = code_archive(repo / "regressors" / "diabetes").sha256  # the tagged files, before the change
    # The branch moves on past the tag with a job that would fail: the run must not take it.
    (repo / "regressors" / "diabetes" / "train.py").write_text("raise SystemExit('not the tagged commit')\n")
    git("commit", "-q", "-am", "broken")
    assert git("rev-parse", "HEAD") != tagged

    source = f"git+file://{repo}@v1#subdirectory=regressors/diabetes"
    model = f"diabetes-git-{uuid.uuid4().hex[:8]}"
    stack = Stack.embedded()
    try:
        result = retrain(
            workload=source,
            training=TrainingSpec(model_name=model, hyperparameters={"alpha": 0.05}),
            serving=ServingSpec(service_name=model),
        )
        client = MlflowClient(tracking_uri=stack.tracking.tracking_uri)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags["gpuferry.workload.source"] == source
        assert tags["gpuferry.workload.commit"] == tagged and tags["gpuferry.workload.dirty"] == "false"
        assert tags["gpuferry.workload.code_sha256"] == expected_code
        assert tags["gpuferry.workload"] == "diabetes-elasticnet"
        assert run.data.params["alpha"] == "0.05" and "val_rmse" in run.data.metrics  # the tagged train.py ran
        (version,) = client.search_model_versions(f"name = '{model}'")
        assert str(version.version) == result.model_version.version and version.run_id == result.run_id
        assert version.tags["gpuferry.workload.commit"] == tagged
        assert version.tags["gpuferry.workload.code_sha256"] == expected_code
    finally:
        stack.serving.undeploy(model)
