"""prefect.yaml against the real Prefect server (scripts/prefect.sh) and MLflow server (scripts/mlflow.sh).

`prefect deploy --all` registers the deployments; the stack's process worker runs them. The MLflow
server calls our webhook receiver (a real process), which emits the event the deploy-model
deployment's trigger matches; the worker deploys the version with the embedded LocalServing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from blocks.base.proc import free_port
from blocks.base.storage import write_manifest
from deployments import mlflow_events
from deployments.poll_registry import RegistryPoller
from deployments.webhook import sign
from tests.private_worker import wait_until
from tests.stacks import mlflow_server, stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SECRET = "test-" + uuid.uuid4().hex
DEADLINE = 180.0  # seconds: a worker on a busy 2-core machine


def wait_for(what: str, check: Callable[[], Any], timeout: float = DEADLINE, interval: float = 0.25) -> Any:
    return wait_until(what, check, timeout, interval)


class World:
    """Everything the tests share: the servers' settings, the test's model, stack and receiver."""

    def __init__(self, prefect: dict[str, str], tracking: Any, tmp: Path) -> None:
        self.api_url = prefect["PREFECT_API_URL"]
        self.tracking = tracking  # the mlflow stack's server and its login (an MlflowTracking block)
        self.tracking_uri = tracking.tracking_uri
        self.tmp = tmp
        self.uid = uuid.uuid4().hex[:8]
        self.model = f"gpuferry-test-{self.uid}"
        self.stack = f"gpuferry-test-{self.uid}"
        self.serving_dir = tmp / "serving"
        self.receiver: subprocess.Popen[bytes] | None = None
        self.receiver_url = ""
        self.env = {**os.environ, "PREFECT_API_URL": self.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.env.pop("PREFECT_HOME", None)
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
            self.env.pop(name, None)  # the receiver logs in to MLflow with the saved stack's block only

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def runs_of(self, deployment: str, **parameters: str) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        with self.client() as client:
            dep = client.read_deployment_by_name(deployment)
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])), limit=200
            )
        return [r for r in runs if all(str(r.parameters.get(k)) == v for k, v in parameters.items())]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    prefect_env, tracking = stack_env("prefect"), mlflow_server()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    w = World(prefect_env, tracking, tmp_path_factory.mktemp("deployments"))
    with temporary_settings({PREFECT_API_URL: w.api_url}):
        deploy = subprocess.run(
            [str(REPO / ".venv/bin/prefect"), "--no-prompt", "deploy", "--all"],
            cwd=REPO,
            env=w.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        save_stack(w)
        register_versions(w, 3)
        start_receiver(w)
        prime_webhook(w)
        try:
            yield w
        finally:
            from deployments.webhook import unregister_webhook

            unregister_webhook(w.tracking, w.stack)  # the MLflow server is shared: leave no webhook behind
            if w.receiver is not None:
                w.receiver.terminate()
                w.receiver.wait(30)
            finish_runs(w)
            from blocks.local.serving import LocalServing

            LocalServing(state_dir=str(w.serving_dir)).undeploy(w.model)
            w.tracking.client.delete_registered_model(w.model)
            w.tracking.client.delete_registered_model(f"{w.model}-primer")


def finish_runs(w: World) -> None:
    """After a failure: let this module's runs end (cancel what is left) so no server outlives the tests."""
    from prefect.states import Cancelled

    try:
        for run in w.runs_of("deploy-model/on-champion", model_name=w.model):
            if not (run.state and run.state.is_final()):
                with w.client() as client:
                    client.set_flow_run_state(run.id, Cancelled(message="test teardown"), force=True)
        wait_for(
            "the runs to end",
            lambda: all(
                r.state and r.state.is_final() for r in w.runs_of("deploy-model/on-champion", model_name=w.model)
            ),
            timeout=60,
        )
    except Exception as exc:  # noqa: BLE001 - best effort; the test's own failure is what matters
        print(f"teardown: {exc}")


def save_stack(w: World) -> None:
    from blocks.local.serving import LocalServing
    from blocks.stack import Stack

    stack = Stack.embedded()
    # The worker's runs and the webhook receiver (--register) log in with the block's login, saved with it;
    # neither process has it in its environment.
    stack.tracking = w.tracking
    stack.serving = LocalServing(state_dir=str(w.serving_dir), drain_seconds=5)
    stack.save(w.stack, overwrite=True)


def register_versions(w: World, count: int) -> None:
    """``count`` versions whose sources are real checkpoints (MLflow models with their manifest) in their run's
    (local) artifact directory, registered without gpuferry (no tags saying how they are served)."""
    import mlflow.sklearn
    from sklearn.linear_model import LinearRegression

    client = w.tracking.client
    experiment = client.create_experiment(f"gpuferry-test-{w.uid}", artifact_location=(w.tmp / "artifacts").as_uri())
    client.create_registered_model(w.model)
    for i in range(count):
        run = client.create_run(experiment)
        source = f"{run.info.artifact_uri}/checkpoint"
        path = Path(urlparse(source).path)
        x = np.random.default_rng(i).normal(size=(8, 3))
        model = LinearRegression().fit(x, x @ np.array([1.0, 2.0, float(i)]))
        mlflow.sklearn.save_model(model, str(path), input_example=x[:2], pip_requirements=["scikit-learn"])
        write_manifest(path)  # the server serves only a checkpoint with a manifest
        client.create_model_version(w.model, source=source, run_id=run.info.run_id)
        client.set_terminated(run.info.run_id)


def start_receiver(w: World) -> None:
    port = free_port("127.0.0.1")
    w.receiver_url = f"http://127.0.0.1:{port}"
    log = open(w.tmp / "receiver.log", "wb")  # noqa: SIM115 - closed with the process
    w.receiver = subprocess.Popen(
        [
            PY,
            "-m",
            "deployments.webhook",
            "--port",
            str(port),
            "--stack",
            w.stack,
            "--register",
            "--webhook-name",
            w.stack,
            "--model",
            w.model,
        ],
        cwd=REPO,
        env={**w.env, "GPUFERRY_WEBHOOK_SECRET": SECRET},
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def up() -> bool:
        assert w.receiver.poll() is None, (w.tmp / "receiver.log").read_text()[-3000:]
        try:
            return httpx.get(f"{w.receiver_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("the webhook receiver", up, timeout=120)


def prime_webhook(w: World) -> None:
    """Wait until MLflow calls the new webhook for alias events.

    MLflow caches each event type's webhook list for MLFLOW_WEBHOOK_CACHE_TTL seconds: an alias set
    while the list cached before our webhook existed (another user's event, moments earlier) is never
    delivered to it. Alias moves on a model of its own (the receiver ignores it) until one arrives.
    """
    client = w.tracking.client
    primer = f"{w.model}-primer"
    source = client.get_model_version(w.model, "1")
    client.create_registered_model(primer)
    client.create_model_version(primer, source=source.source, run_id=source.run_id)
    before = counts(w)["accepted"]
    deadline = time.monotonic() + DEADLINE
    while True:
        client.set_registered_model_alias(primer, "primer", "1")
        try:
            wait_for("a delivery", lambda: counts(w)["accepted"] > before, timeout=10)
            return
        except AssertionError:
            assert time.monotonic() < deadline, f"MLflow called the webhook for no alias event in {DEADLINE:.0f} s"


def counts(w: World) -> dict[str, int]:
    return httpx.get(f"{w.receiver_url}/healthz", timeout=10).json()


def signed_post(
    w: World,
    payload: dict,
    delivery_id: str,
    secret: str = SECRET,
    timestamp: int | None = None,
    signature: str | None = None,
) -> httpx.Response:
    body = json.dumps(payload).encode()
    ts = str(int(time.time()) if timestamp is None else timestamp)
    headers = {
        "Content-Type": "application/json",
        "X-MLflow-Delivery-Id": delivery_id,
        "X-MLflow-Timestamp": ts,
        "X-MLflow-Signature": signature if signature is not None else sign(secret, delivery_id, ts, body),
    }
    return httpx.post(f"{w.receiver_url}/mlflow", content=body, headers=headers, timeout=30)


def alias_payload(model: str, version: str, alias: str = "champion") -> dict:
    return {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": datetime.now(UTC).isoformat(),
        "data": {"name": model, "alias": alias, "version": version},
    }


def wait_completed(w: World, run_id: Any) -> Any:
    def done() -> Any:
        with w.client() as client:
            run = client.read_flow_run(run_id)
        if run.state and run.state.is_final():
            return run
        return None

    run = wait_for(f"flow run {run_id} to finish", done)
    assert run.state.is_completed(), f"{run.name}: {run.state.type} {run.state.message}"
    return run


def serving(w: World) -> dict | None:
    from blocks.local.serving import LocalServing

    return LocalServing(state_dir=str(w.serving_dir)).current(w.model)  # the model's name: no service recorded


# ------------------------------------------------------------------------------------------------ tests


def test_deploy_all_registers_a_deployment_for_every_flow(world: World) -> None:
    expected = {
        "retrain/weekly": "flows/retrain.py:retrain",
        "sweep/sweep": "flows/sweep.py:sweep",
        "deploy-model/on-champion": "flows/deploy_model.py:deploy_model",
        "provision/provision": "flows/provision.py:provision",
        "release/release": "flows/provision.py:release",
    }
    with world.client() as client:
        registered = {name: client.read_deployment_by_name(name) for name in expected}
    assert {name: dep.entrypoint for name, dep in registered.items()} == expected
    assert {dep.work_pool_name for dep in registered.values()} == {"gpuferry"}
    assert registered["sweep/sweep"].parameters["grid"]["values"]["lr"] == [0.001, 0.003, 0.01]
    assert registered["provision/provision"].parameters["count"] == 1
    assert "nodes" in registered["release/release"].parameter_openapi_schema["required"]


def test_weekly_retrain_is_scheduled_for_the_next_monday_3am(world: World) -> None:
    with world.client() as client:
        dep = client.read_deployment_by_name("retrain/weekly")
        assert dep.work_pool_name == "gpuferry"
        assert dep.parameters["workload"] == "examples/digits"
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules] == [("0 3 * * 1", "UTC", True)]
        # Ask the scheduler for the runs now instead of waiting for its next loop.
        response = client.request("POST", "/deployments/{id}/schedule", path_params={"id": dep.id}, json={})
        assert response.status_code in (200, 201), response.text
    now = datetime.now(UTC)
    monday_3am = (now + timedelta(days=-now.weekday())).replace(hour=3, minute=0, second=0, microsecond=0)
    expected = monday_3am if monday_3am > now else monday_3am + timedelta(days=7)
    runs = world.runs_of("retrain/weekly")
    scheduled = sorted(r.expected_start_time for r in runs if r.state_type and r.state_type.value == "SCHEDULED")
    assert scheduled, "no scheduled runs"
    assert scheduled[0] == expected
    assert all(t.weekday() == 0 and (t.hour, t.minute) == (3, 0) for t in scheduled)


def test_alias_set_in_mlflow_deploys_that_version(world: World) -> None:
    set_at = time.monotonic()
    world.tracking.client.set_registered_model_alias(world.model, "champion", "1")
    run = wait_for(
        "a deploy-model run for v1", lambda: world.runs_of("deploy-model/on-champion", model_name=world.model)
    )
    created_s = time.monotonic() - set_at
    assert len(run) == 1
    run = run[0]
    assert run.parameters == {
        "model_name": world.model,
        "version": "1",
        "alias": "champion",
        "stack": world.stack,
        "skip_if_moved": True,
    }
    assert run.created_by and run.created_by.type == "AUTOMATION"

    def running() -> bool:
        with world.client() as client:
            state = client.read_flow_run(run.id).state
        return state is not None and (state.is_running() or state.is_final())

    wait_for("the run to start", running)
    running_s = time.monotonic() - set_at
    wait_completed(world, run.id)
    print(
        f"alias set → run created {created_s:.2f} s, → running {running_s:.2f} s, → completed "
        f"{time.monotonic() - set_at:.2f} s"
    )
    current = serving(world)
    assert current is not None and current["version"] == "1" and current["model_name"] == world.model
    answer = httpx.post(f"{current['url']}/invocations", json={"inputs": [[0.5, 0.5, 0.5]]}, timeout=30)
    assert answer.status_code == 200 and answer.json()["predictions"] == [pytest.approx(1.5, abs=1e-6)]


def test_forged_and_stale_webhooks_are_rejected(world: World) -> None:
    before = counts(world)
    payload = alias_payload(world.model, "999")
    forged = signed_post(world, payload, "forged-1", secret="not-the-secret")
    unsigned = httpx.post(f"{world.receiver_url}/mlflow", json=payload, timeout=30)
    stale = signed_post(world, payload, "stale-1", timestamp=int(time.time()) - 3600)
    tampered = signed_post(
        world, payload, "tampered-1", signature=sign(SECRET, "tampered-1", str(int(time.time())), b'{"other": "body"}')
    )
    assert [forged.status_code, unsigned.status_code, stale.status_code, tampered.status_code] == [401] * 4
    after = counts(world)
    assert after["rejected"] - before["rejected"] == 4
    assert after["emitted"] == before["emitted"]


def test_duplicates_and_both_bridges_deploy_once(world: World) -> None:
    before = serving(world)
    assert before is not None and before["version"] == "1"
    # MLflow resends a delivery (champion → v1 again): the receiver emits it once; a copy sent by
    # another receiver carries the same event id and the Prefect server drops it.
    # Delivery ids are unique per test run: the Prefect server remembers event ids across runs.
    delivery = f"delivery-again-v1-{world.model}"
    first = signed_post(world, alias_payload(world.model, "1"), delivery)
    again = signed_post(world, alias_payload(world.model, "1"), delivery)
    assert (first.status_code, first.json()["status"]) == (200, "emitted")
    assert (again.status_code, again.json()["status"]) == (200, "duplicate")
    copy = mlflow_events.alias_set_event(
        world.model, "1", "champion", stack=world.stack, via="webhook", id_parts=("mlflow-webhook", delivery)
    )
    assert str(copy["id"]) == first.json()["event_id"]
    mlflow_events.emit(copy)
    mlflow_events.flush()

    # The same change seen by the webhook and by the poller: the poller finds it reported already.
    tracking = world.tracking
    poller = RegistryPoller(
        tracking.alias_map, tracking_uri=world.tracking_uri, stack=world.stack, models=[world.model]
    )
    assert poller.poll_once() == []  # the first poll records champion → v1
    tracking.client.set_registered_model_alias(world.model, "champion", "3")
    wait_for(
        "the webhook's event for v3",
        lambda: mlflow_events.recently_emitted(world.model, "3", "champion", timedelta(minutes=5)),
    )
    assert poller.poll_once() == []
    assert poller.seen == {world.model: {"champion": "3"}}

    v3 = wait_for("the v3 run", lambda: world.runs_of("deploy-model/on-champion", model_name=world.model, version="3"))
    # The repeated v1 delivery makes one more run (its copies are dropped); the automation may evaluate it
    # after the v3 event, so wait for it rather than assume the order.
    wait_for(
        "the repeated v1 delivery's run",
        lambda: len(world.runs_of("deploy-model/on-champion", model_name=world.model, version="1")) >= 2,
    )
    v1 = world.runs_of("deploy-model/on-champion", model_name=world.model, version="1")
    v3 = world.runs_of("deploy-model/on-champion", model_name=world.model, version="3")
    assert len(v1) == 2 and len(v3) == 1  # the first alias set, and the one repeated delivery
    assert world.runs_of("deploy-model/on-champion", model_name=world.model, version="999") == []  # forged ones
    for run in (*v1, *v3):
        wait_completed(world, run.id)
    after = serving(world)
    # The repeated v1 run either found v1 serving (nothing changed) or ran after v3 and found the alias
    # moved on (stale: nothing deployed); either way v3 serves, deployed once.
    assert after is not None and after["version"] == "3" and after["pid"] != before["pid"]
    started = sorted(p.name.rsplit("-", 1)[0] for p in world.serving_dir.glob(f"{world.model}-v*.log"))
    assert started == [f"{world.model}-v1", f"{world.model}-v3"]  # one server process per version ever started
