"""A canary on the Docker backend (the registry stack's podman): the front sends a share of live traffic to the new
version, and its own /metrics against the serving version's decide. A version that fails a fifth of its requests
is removed and the old one serves every request again; a healthy one takes over. Clients through the service's
address see no failed delivery (no refused connection, no 502) in either, only the failing canary's own failures
during its window (400: the model raised, as MLflow's server answers)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import docker
import httpx
import pytest
from prefect_docker.host import DockerHost

from blocks.base.serving import DeployOutcome, Release
from blocks.docker.serving import DockerServing
from blocks.errors import CanaryFailed, ConfigurationError
from blocks.records import ImageRef, ServerSpec
from blocks.specs import RolloutPolicy, ServingSpec
from tests.fake_gpus import FakeGpus
from tests.pyfunc_models import canary_models
from tests.test_docker_compute import credentials, engine, stack  # noqa: F401 - fixtures
from tests.test_docker_serving import _inventory, gpus, images, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

SMOKE = {"dataframe_records": [{"x": 1.0}]}
POLICY = RolloutPolicy(
    strategy="canary", share=0.25, window_seconds=20, min_requests=20, max_p99_ratio=3, p99_slack_ms=50
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """y = 2x; ``failing`` raises on every multiple of 5 (a fifth of the load below), ``differing`` answers 3x for
    every multiple of 3 (a third of the load of x cycling 1..6)."""
    return canary_models(tmp_path_factory.mktemp("canary-models"))


@pytest.fixture
def serving(stack: dict[str, str], gpus: FakeGpus) -> Iterator[DockerServing]:
    block = DockerServing(
        docker_host=DockerHost(base_url=stack["DOCKER_HOST"]),
        registry_credentials=credentials(stack),
        cdi_kind=gpus.kind,
        health_interval_seconds=2,
        drain_seconds=5,
        env={"WARMUP_ITERATIONS": "1"},
    ).with_inventory(_inventory(gpus))
    assert isinstance(block, DockerServing)
    yield block
    block.undeploy(SERVICE)


SERVICE = f"canary-{uuid.uuid4().hex[:6]}"


def release(version: str, image: ImageRef, uri: str) -> Release:
    return Release(model_name="canary", version=version, model_uri=uri, image=image, server=ServerSpec())


def spec(rollout: RolloutPolicy | None = None) -> ServingSpec:
    return ServingSpec(service_name=SERVICE, smoke_request=SMOKE, ready_timeout_seconds=240, rollout=rollout)


def predict_status(url: str) -> int:
    try:
        return httpx.post(f"{url}/invocations", json=SMOKE, timeout=30).status_code
    except httpx.HTTPError:
        return 0


class Load:
    """Clients asking the service's address at a steady pace, x cycling 1..``cycle``: (x, status; 0: no answer);
    ``predictions``: (x, what a 200 answered)."""

    def __init__(self, url: str, clients: int = 4, cycle: int = 5) -> None:
        self.url, self.cycle = url, cycle
        self.answers: list[tuple[float, int]] = []
        self.predictions: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(i,)) for i in range(clients)]

    def _ask(self, index: int) -> None:
        with httpx.Client(timeout=30) as client:
            n = index
            while not self._stop.is_set():
                x = float(n % self.cycle + 1)
                n += 1
                try:
                    answer = client.post(f"{self.url}/invocations", json={"dataframe_records": [{"x": x}]})
                    status = answer.status_code
                    if status == 200:
                        self.predictions.append((x, answer.json()["predictions"][0]))
                except httpx.HTTPError:
                    status = 0
                self.answers.append((x, status))
                self._stop.wait(0.02)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        wait_for(lambda: len(self.answers) >= 20)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def undelivered(self) -> list[tuple[float, int]]:
        """Requests the service did not deliver to a version: no answer, or the front's 502."""
        return [a for a in self.answers if a[1] in (0, 502)]


def test_a_failing_canary_is_removed_and_a_healthy_one_takes_over(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], models: dict[str, str], engine: docker.DockerClient
) -> None:
    image = images[0]
    first = serving.deploy(spec(), release("1", image, models["good"]))
    with Load(first.url) as load:
        with pytest.raises(CanaryFailed) as caught:
            serving.deploy(spec(POLICY), release("2", image, models["failing"]))
        served_after = len(load.answers)
        wait_for(lambda: len(load.answers) >= served_after + 40)
    failed = caught.value
    assert failed.version == "2" and failed.serving_version == "1"
    assert failed.reasons and failed.reasons[0].startswith("error rate "), failed.reasons
    assert 0.1 <= failed.numbers["candidate_error_rate"] <= 0.3 and failed.numbers["current_error_rate"] == 0
    assert not load.undelivered(), load.undelivered()[:5]
    assert {status for _, status in load.answers[served_after:]} == {200}  # v1 answers everything again
    # The canary's own failures (its model raised: 400, as MLflow answers), during its window only.
    assert {s for x, s in load.answers if s != 200} == {400}
    assert all(x == 5.0 for x, s in load.answers if s == 400)
    assert serving.current(SERVICE)["version"] == "1"
    names = [c.name for c in engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={SERVICE}"})]
    assert sorted(names) == sorted([serving.active_name(SERVICE), serving.front_name(SERVICE)])
    tags = DeployOutcome.from_error(release("2", image, models["failing"]), failed).tags()
    assert tags["deploy.status"] == "canary_failed" and tags["deploy.failed_version"] == "2"
    assert tags["deploy.rolled_back_to"] == "1" and tags["deploy.rollout.strategy"] == "canary"
    assert float(tags["deploy.rollout.candidate_error_rate"]) == failed.numbers["candidate_error_rate"]

    with Load(first.url) as load:
        second = serving.deploy(spec(POLICY), release("3", image, models["good"]))
        switched = len(load.answers)
        wait_for(lambda: len(load.answers) >= switched + 40)
    assert {status for _, status in load.answers} == {200}, [a for a in load.answers if a[1] != 200][:5]
    measured = second.detail["rollout"]
    share = measured["candidate_requests"] / (measured["candidate_requests"] + measured["current_requests"])
    assert abs(share - POLICY.share) <= 0.03, measured
    assert measured["candidate_error_rate"] == 0 and second.previous_version == "1"
    assert serving.current(SERVICE)["version"] == "3"
    tags = DeployOutcome.deployed(release("3", image, models["good"]), second).tags()
    assert tags["deploy.status"] == "deployed" and tags["deploy.rollout.strategy"] == "canary"


SHADOW = RolloutPolicy(
    strategy="shadow", share=1, window_seconds=20, min_requests=20, max_p99_ratio=3, p99_slack_ms=50, min_agreement=0.95
)


def test_a_shadow_that_disagrees_is_removed_and_no_client_ever_gets_a_shadows_answer(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], models: dict[str, str], engine: docker.DockerClient
) -> None:
    image = images[0]
    first = serving.deploy(spec(), release("1", image, models["good"]))
    with Load(first.url, cycle=6) as load:
        with pytest.raises(CanaryFailed) as caught:
            serving.deploy(spec(SHADOW), release("2", image, models["differing"]))
        passed = serving.deploy(spec(SHADOW), release("3", image, models["good"]))
        switched = len(load.answers)
        wait_for(lambda: len(load.answers) >= switched + 40)
    failed = caught.value
    assert failed.numbers["strategy"] == "shadow" and failed.serving_version == "1"
    assert failed.numbers["agreement"] == pytest.approx(2 / 3, abs=0.05), failed.numbers
    assert any("rows agree with the version serving (min_agreement=0.95)" in r for r in failed.reasons)
    assert failed.numbers["compared_rows"] >= 20 and failed.numbers["candidate_error_rate"] == 0
    assert not load.undelivered() and {s for _, s in load.answers} == {200}
    assert all(y == 2 * x for x, y in load.predictions), [p for p in load.predictions if p[1] != 2 * p[0]][:5]
    measured = passed.detail["rollout"]
    assert measured["strategy"] == "shadow" and measured["agreement"] == 1.0 and passed.previous_version == "1"
    assert serving.current(SERVICE)["version"] == "3"
    names = [c.name for c in engine.containers.list(all=True, filters={"label": f"io.gpuferry.service={SERVICE}"})]
    assert sorted(names) == sorted([serving.active_name(SERVICE), serving.front_name(SERVICE)])


@pytest.mark.usefixtures("prefect_server")
def test_the_alias_moves_only_to_a_version_that_passed_its_canary(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], models: dict[str, str], tmp_path: Path
) -> None:
    """As a retrain ships a version that beat the champion (flows/ship.py): registered without the alias, deployed
    as a canary, the alias moved only when it passed; a failed one carries the verdict and the champion stays."""
    from prefect import flow

    from blocks.records import CheckpointRef
    from blocks.specs import PromotionPolicy
    from blocks.tracking.mlflow import MlflowTracking
    from flows.ship import serve_version
    from tasks.track import register_model

    tracking = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    stack = SimpleNamespace(serving=serving, tracking=tracking)
    policy = PromotionPolicy(metric="m", direction="maximize")

    @flow(name="canary-ship-probe")
    def ship_one(model: str, value: float, rollout: RolloutPolicy | None) -> str:
        run_id = tracking.start_run("canary-ship", f"m={value}", {})
        judged = rollout is not None and rollout.strategy != "rolling"
        uri = models[model]
        checkpoint = CheckpointRef(uri=uri, sha256="0" * 64, size_bytes=1, files=1)
        version = register_model(tracking, run_id, "canary-model", checkpoint, policy, value, {}, move_alias=not judged)
        release = Release(
            model_name="canary-model", version=version.version, model_uri=uri, image=images[0], server=ServerSpec()
        )
        serve_version(stack, spec(rollout), release, version, policy.alias)  # a Stack's serving and tracking
        return version.version

    first = ship_one("good", 0.5, None)
    assert tracking.version_by_alias("canary-model", "champion") == first
    url = serving.current(SERVICE)["url"]
    with Load(url), pytest.raises(CanaryFailed):
        ship_one("failing", 0.9, POLICY)
    failed = str(int(first) + 1)
    assert tracking.version_by_alias("canary-model", "champion") == first  # the champion stays
    tags = tracking.version_tags("canary-model", failed)
    assert tags["promotion"] == "candidate" and tags["deploy.status"] == "canary_failed"
    assert float(tags["deploy.rollout.candidate_error_rate"]) > 0.1 and tags["deploy.rolled_back_to"] == first
    with Load(url):
        passed = ship_one("good", 0.9, POLICY)
    assert tracking.version_by_alias("canary-model", "champion") == passed != failed
    tags = tracking.version_tags("canary-model", passed)
    assert tags["promotion"] == "promoted" and tags["deploy.status"] == "deployed"
    assert tags["deploy.rollout.strategy"] == "canary" and serving.current(SERVICE)["version"] == passed


def test_a_window_shows_its_state_and_ends_when_promoted_or_aborted_by_hand(
    serving: DockerServing, images: tuple[ImageRef, ImageRef], models: dict[str, str]
) -> None:
    """What `gpuferry rollout status|promote|abort` call: the window's state as its deploy last wrote it, and a
    decision the deploy reads back within a tick."""
    image = images[0]
    first = serving.deploy(spec(), release("1", image, models["good"]))
    with pytest.raises(ConfigurationError, match="no canary or shadow window is under way"):
        serving.decide_rollout(SERVICE, "promote")
    long = POLICY.model_copy(update={"window_seconds": 600})
    outcome: dict[str, object] = {}

    def deploy(version: str) -> None:
        try:
            outcome[version] = serving.deploy(spec(long), release(version, image, models["good"]))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome[version] = exc

    with Load(first.url):
        for version, decision in (("2", "promote"), ("3", "abort")):
            worker = threading.Thread(target=deploy, args=(version,))
            worker.start()
            wait_for(lambda: (serving.rollout_status(SERVICE) or {}).get("answered", 0) > 0, 300)
            state = serving.rollout_status(SERVICE)
            assert state is not None and state["version"] == version and state["strategy"] == "canary"
            assert state["share"] == 0.25 and state["seconds"] >= 10 and state["error_rate"] == 0
            serving.decide_rollout(SERVICE, decision)
            worker.join(300)
            assert not worker.is_alive() and serving.rollout_status(SERVICE) is None
    promoted, aborted = outcome["2"], outcome["3"]
    assert not isinstance(promoted, Exception), promoted
    assert promoted.detail["rollout"]["decided_by_hand"] == "promote"
    assert promoted.detail["rollout"]["window_seconds"] < 600
    assert isinstance(aborted, CanaryFailed) and aborted.reasons == ["aborted by hand (gpuferry rollout abort)"]
    assert serving.current(SERVICE)["version"] == "2"

    # A window its deploy left under way (the process killed): the next deploy ends it before anything else.
    from blocks.docker.spec import LABEL_FRONT_TARGET

    front = serving.front_name(SERVICE)
    labels = serving.engine().inspect(serving.active_name(SERVICE))["Config"]["Labels"]
    serving._front_command(front, "rollout", "set", json.dumps({"version": "9", "strategy": "canary"}))
    serving._set_target(front, f"{labels[LABEL_FRONT_TARGET]}=0.5", "gone-away:8080=0.5")
    fourth = serving.deploy(spec(), release("4", image, models["good"]))
    assert serving.rollout_status(SERVICE) is None and fourth.previous_version == "2"
    assert {predict_status(fourth.url) for _ in range(20)} == {200}
