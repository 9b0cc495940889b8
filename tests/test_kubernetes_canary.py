"""Canary and shadow rollouts on the local Kubernetes node (`make k8s-up`): the new version runs as its own
Deployment, the serving pods send it a share of their requests (or a copy) as their route file says, and both
versions' /metrics, read through the API server's pod proxy, decide. A steady load through the Service's
ClusterIP, from inside the node, runs during each window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from blocks.base.serving import Release
from blocks.errors import CanaryFailed
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.records import ImageRef
from blocks.specs import RolloutPolicy, ServingSpec
from tests.k8s_node import PULL_SECRET, ServiceLoad
from tests.private_worker import wait_until
from tests.pyfunc_models import canary_models
from tests.test_kubernetes import admin

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SMOKE = {"dataframe_records": [{"x": 1.0}]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("canary-models")
    uris = canary_models(root)
    for p in (root, *root.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root, {name: f"file:///models/{Path(uri).name}" for name, uri in uris.items()}


def canary_block(k8s: dict[str, str], namespace: str, models_root: str) -> KubernetesCluster:
    return admin(
        k8s,
        namespace=namespace,
        rollout_timeout_seconds=240,
        cpu_request="10m",
        memory_request="64Mi",
        image_pull_secret=PULL_SECRET,
        host_path_mounts={models_root: "/models"},
        env={"WARMUP_ITERATIONS": "1", "MODEL_DEVICE": "cpu"},
    )


@pytest.fixture
def block(k8s: dict[str, str], k8s_namespace: str, models: tuple[Path, dict[str, str]]) -> KubernetesCluster:
    return canary_block(k8s, k8s_namespace, str(models[0]))


# A deploy in a process of its own (killed during its window by the test): argv namespace, models, image, model URI.
DEPLOY_IN_A_PROCESS = """
import sys
from tests.stacks import stack_env
from tests.test_kubernetes_canary import canary_block, policy, release, spec
namespace, models, image, uri = sys.argv[1:]
long = policy("canary", 0.5).model_copy(update={"window_seconds": 600})
canary_block(stack_env("k8s"), namespace, models).deploy(spec(long), release(image, "2", uri))
"""


def spec(rollout: RolloutPolicy | None) -> ServingSpec:
    return ServingSpec(
        service_name="canary", smoke_request=SMOKE, replicas=2, ready_timeout_seconds=240, rollout=rollout
    )


def release(image: str, version: str, uri: str) -> Release:
    ref = ImageRef(builder="docker", content_tag=version, reference=image, built=True)
    return Release(model_name="canary", version=version, model_uri=uri, image=ref)


def load_on(block: KubernetesCluster, k8s: dict[str, str], x: float) -> ServiceLoad:
    svc = block._api().get(f"/api/v1/namespaces/{block.namespace}/services/canary")
    url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
    return ServiceLoad(k8s["K8S_NODE_NETNS"], url, {"dataframe_records": [{"x": x}]}, rate=20, max_seconds=600)


def predictions(load: ServiceLoad) -> list[Any]:
    return [a for a in load.answers if a.path == "/invocations"]


def policy(strategy: str, share: float) -> RolloutPolicy:
    return RolloutPolicy.model_validate(
        {
            "strategy": strategy,
            "share": share,
            "window_seconds": 25,
            "min_requests": 20,
            "max_p99_ratio": 5,
            "p99_slack_ms": 200,
        }
    )


def test_a_failing_canary_is_removed_and_a_healthy_one_takes_over_with_no_undelivered_request(
    k8s: dict[str, str], block: KubernetesCluster, models: tuple[Path, dict[str, str]], workload_image: str
) -> None:
    uris = models[1]
    block.deploy(spec(None), release(workload_image, "1", uris["good"]))
    canary = policy("canary", 0.25)
    load = load_on(block, k8s, 5.0).start()  # x = 5: the failing version fails every request it gets
    try:
        wait_until("answers", lambda: len(load.answers) >= 20, timeout=120, interval=0.2)
        with pytest.raises(CanaryFailed) as failed:
            block.deploy(spec(canary), release(workload_image, "2", uris["failing"]))
        during = len(load.answers)
        assert block._candidate("canary-canary") is None  # removed
        assert block.current("canary")["version"] == "1"
        wait_until("answers after", lambda: len(load.answers) >= during + 40, timeout=120, interval=0.2)
        after = [a.status for a in predictions(load)[during // 2 :]]
        assert set(after) == {200}, after  # v1 answers everything once the canary is gone

        passed = block.deploy(spec(canary), release(workload_image, "3", uris["good"]))
        mark = len(load.answers)
        wait_until("answers after", lambda: len(load.answers) >= mark + 20, timeout=120, interval=0.2)
    finally:
        answers = load.stop()
    numbers = failed.value.numbers
    assert numbers["candidate_error_rate"] == 1.0 and numbers["current_error_rate"] == 0.0
    assert failed.value.serving_version == "1" and failed.value.version == "2"
    # Every request was delivered: the failing canary's own answers (400: the model raised) and v1's 200s only.
    assert {a.status for a in answers} <= {200, 400}, [a for a in answers if a.status not in (200, 400)][:5]
    # The share asked for, per request (a keep-alive client on one connection): within 3 points of 25 %.
    share = numbers["candidate_requests"] / (numbers["candidate_requests"] + numbers["current_requests"])
    assert abs(share - 0.25) <= 0.03, numbers
    assert passed.model_version == "3" and block.current("canary")["version"] == "3"
    assert passed.detail["rollout"]["candidate_error_rate"] == 0.0
    assert passed.detail["rollout"]["decision_s"] <= 10
    assert block._candidate("canary-canary") is None and block.services() == ["canary"]


def test_a_shadow_that_disagrees_is_not_promoted_and_no_client_gets_its_answers(
    k8s: dict[str, str], block: KubernetesCluster, models: tuple[Path, dict[str, str]], workload_image: str
) -> None:
    uris = models[1]
    block.deploy(spec(None), release(workload_image, "1", uris["good"]))
    shadow = policy("shadow", 0.5)
    load = load_on(block, k8s, 3.0).start()  # x = 3: v1 answers 6, the differing version 9
    try:
        wait_until("answers", lambda: len(load.answers) >= 20, timeout=120, interval=0.2)
        with pytest.raises(CanaryFailed) as failed:
            block.deploy(spec(shadow), release(workload_image, "2", uris["differing"]))
    finally:
        answers = load.stop()
    assert failed.value.numbers["agreement"] == 0.0 and "rows agree" in str(failed.value)
    assert block._candidate("canary-shadow") is None and block.current("canary")["version"] == "1"
    assert {a.status for a in answers} == {200}
    got = {tuple(a.body["predictions"]) for a in predictions(load)}
    assert got == {(6.0,)}, got  # v1's answer to x = 3, never the shadow's 9


@pytest.mark.usefixtures("prefect_server")
def test_the_cli_decides_a_window_and_the_alias_follows_the_verdict(
    block: KubernetesCluster, models: tuple[Path, dict[str, str]], workload_image: str, tmp_path: Path
) -> None:
    """As a retrain ships a version that beat the champion (flows/ship.py), on the Kubernetes node: registered
    without the alias, its window seen with `gpuferry rollout status` and ended with `gpuferry rollout abort` (the
    champion stays, the version carries the verdict) or `promote` (the alias moves to it), the installed command
    against a saved stack."""
    from prefect import flow
    from prefect.settings import PREFECT_API_URL

    from blocks.local.compute import LocalProcesses
    from blocks.local.images import CurrentEnvironment
    from blocks.local.provider import LocalMachine
    from blocks.local.storage import LocalCheckpointStore
    from blocks.records import CheckpointRef
    from blocks.specs import PromotionPolicy
    from blocks.stack import Stack
    from blocks.tracking.mlflow import MlflowTracking
    from flows.ship import serve_version
    from tasks.track import register_model

    uris = models[1]
    tracking = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    stack_name = f"k8s-canary-{block.namespace}"
    Stack(
        provider=LocalMachine(),
        images=CurrentEnvironment(),
        compute=LocalProcesses(),
        storage=LocalCheckpointStore(),
        tracking=tracking,
        serving=block,
    ).save(stack_name)
    promotion = PromotionPolicy(metric="m", direction="maximize")
    long = policy("canary", 0.5).model_copy(update={"window_seconds": 600})

    @flow(name="k8s-canary-ship-probe")
    def ship_one(value: float, rollout: RolloutPolicy | None) -> str:
        run_id = tracking.start_run("k8s-canary-ship", f"m={value}", {})
        judged = rollout is not None
        checkpoint = CheckpointRef(uri=uris["good"], sha256="0" * 64, size_bytes=1, files=1)
        version = register_model(tracking, run_id, "canary", checkpoint, promotion, value, {}, move_alias=not judged)
        serve_version(
            Stack.named(stack_name),
            spec(rollout),
            release(workload_image, version.version, uris["good"]),
            version,
            promotion.alias,
        )
        return version.version

    def gpuferry(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}  # the test's Prefect server
        command = [str(REPO / ".venv/bin/gpuferry"), "rollout", *args, "canary", "--stack", stack_name]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)

    assert ship_one(0.5, None) == "1"

    def ship(value: float, outcome: dict[str, Any]) -> None:
        try:
            outcome["version"] = ship_one(value, long)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    for value, decision in ((0.8, "abort"), (0.9, "promote")):
        outcome: dict[str, Any] = {}
        worker = threading.Thread(target=ship, args=(value, outcome))
        worker.start()
        try:
            wait_until("the window to start", lambda: block.rollout_status("canary") is not None, timeout=300)
            shown = gpuferry("status", "--json")
            assert shown.returncode == 0, shown.stderr
            state = json.loads(shown.stdout)
            assert state["serving_version"] == "1" and state["strategy"] == "canary" and state["share"] == 0.5
            words = gpuferry("status")
            assert f"canary: v{state['version']} in a canary at 0.5 against v1" in words.stdout, words.stderr
            decided = gpuferry(decision)
            assert decided.returncode == 0 and f"{decision} asked" in decided.stdout, decided.stderr
        finally:
            worker.join(600)
        assert not worker.is_alive() and block.rollout_status("canary") is None
        assert block._candidate("canary-canary") is None
        tags = tracking.version_tags("canary", state["version"])
        assert tags["deploy.rollout.decided_by_hand"] == decision
        if decision == "abort":
            assert isinstance(outcome.get("error"), CanaryFailed), outcome
            assert tags["deploy.status"] == "canary_failed" and tags["promotion"] == "candidate"
            assert tracking.version_by_alias("canary", "champion") == "1"  # the champion stays
            assert block.current("canary")["version"] == "1"
        else:
            assert outcome.get("version") == state["version"] == "3", outcome
            assert tags["deploy.status"] == "deployed" and tags["promotion"] == "promoted"
            assert float(tags["deploy.rollout.window_seconds"]) < 300
            assert tracking.version_by_alias("canary", "champion") == "3"  # the alias followed the verdict
            assert block.current("canary")["version"] == "3"
    after = gpuferry("status")
    assert after.returncode == 0 and "canary: no canary or shadow window is under way" in after.stdout
    refused = gpuferry("abort")
    assert refused.returncode != 0 and "no canary or shadow window is under way" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_window_left_by_a_killed_deploy_is_ended_by_the_next_deploy(
    k8s: dict[str, str], block: KubernetesCluster, models: tuple[Path, dict[str, str]], workload_image: str
) -> None:
    """The deploy's process killed during its window leaves the canary routed to and running; the service's next
    deploy turns the route off and removes the canary before it rolls out, and no client request fails."""
    uris = models[1]
    block.deploy(spec(None), release(workload_image, "1", uris["good"]))
    load = load_on(block, k8s, 1.0).start()
    try:
        wait_until("answers", lambda: len(load.answers) >= 20, timeout=120, interval=0.2)
        argv = [
            sys.executable,
            "-c",
            DEPLOY_IN_A_PROCESS,
            block.namespace,
            str(models[0]),
            workload_image,
            uris["good"],
        ]
        deploying = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until("the window to start", lambda: block.rollout_status("canary") is not None, timeout=300)
        finally:
            deploying.kill()
            _, err = deploying.communicate(timeout=60)
        assert block.rollout_status("canary") is not None, err.decode()[-3000:]  # left as it was
        assert "canary" in route(block)
        third = block.deploy(spec(None), release(workload_image, "3", uris["good"]))
        mark = len(load.answers)
        wait_until("answers after", lambda: len(load.answers) >= mark + 20, timeout=120, interval=0.2)
    finally:
        answers = load.stop()
    assert third.model_version == "3" and third.previous_version == "1"
    assert block.rollout_status("canary") is None and block._candidate("canary-canary") is None
    assert "canary" not in route(block)
    assert {a.status for a in answers} == {200}, [a for a in answers if a.status != 200][:5]


def route(block: KubernetesCluster) -> dict[str, Any]:
    """The route file the serving pods read (the ConfigMap's key): {} when there is none."""
    config = block._api().read_or_none("v1", "ConfigMap", "canary-route", namespace=block.namespace)
    return dict(json.loads((config or {}).get("data", {}).get("route.json", "{}")))
