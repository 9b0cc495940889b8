"""R: a canary on the Docker backend under a steady client load: one that fails a fifth of its requests, then a
healthy one, through the service's address.

Against the registry stack's engine (podman's Docker API; the script runs `make registry-up`, idempotent): the
diabetes example's image serves two pyfunc models, y = 2x, one of which raises on every x that is a multiple of
5 (its answers are 400s, as MLflow's server answers a model's error). v1 (healthy) serves; clients send x
drawn from 1..5 at a steady rate; v2 (failing) is deployed as a canary at ``--share`` for ``--window`` seconds,
then v3 (healthy) the same way. Peers: KServe moves canary traffic but promotion and rollback are manual (its
maintainers point to Argo Rollouts), SkyServe and dstack do rolling or blue-green updates without a verdict;
none runs here, so there is no side-by-side figure, only ours against the goals.

Prints ``RESULT R1_failed_client_requests`` (requests the service did not deliver to a version: no answer, or
the front's 502/503, over both canaries; goal 0), ``RESULT R2_canary_share`` (the share of the window's requests
the passing canary answered, from both versions' own /metrics; goal: the policy's share ± 0.03), ``RESULT
R3_decision_s`` (window end → verdict applied: the front on one version again; the larger of the two; goal
≤ 10) and the figures.

    .venv/bin/python bench/canary.py [--share 0.1] [--window 30] [--rate 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefect_docker.host import DockerHost

from bench.image_build import registry_credentials, stack_env  # `make registry-up`, then its settings
from blocks.base.serving import Release
from blocks.docker.image import DockerImageBuilder
from blocks.docker.serving import DockerServing
from blocks.errors import CanaryFailed
from blocks.records import ServerSpec
from blocks.specs import RolloutPolicy, ServingSpec
from blocks.workload.source import load_workload
from tests.pyfunc_models import canary_models


class SteadyLoad:
    """``rate`` requests a second on a schedule (not waiting for answers to send the next), x drawn from 1..5 (at
    random: the front's split is evenly spaced, so x cycling in step with it would send the canary one x only)."""

    def __init__(self, url: str, rate: float, workers: int = 8) -> None:
        self.url, self.interval = url, 1.0 / rate
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._next = time.monotonic()
        self._lock = threading.Lock()
        self._random = random.Random(0)
        self._threads = [threading.Thread(target=self._run) for _ in range(workers)]

    def _slot(self) -> tuple[float, float]:
        with self._lock:
            at, self._next = self._next, self._next + self.interval
            return at, float(self._random.randint(1, 5))

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                at, x = self._slot()
                self._stop.wait(max(0.0, at - time.monotonic()))
                try:
                    status = client.post(f"{self.url}/invocations", json={"dataframe_records": [{"x": x}]}).status_code
                except httpx.HTTPError:
                    status = 0
                self.statuses.append(status)

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--share", type=float, default=0.1, help="the canary's share of the requests")
    parser.add_argument("--window", type=float, default=30, help="the canary's window, seconds")
    parser.add_argument("--rate", type=float, default=40, help="client requests a second")
    args = parser.parse_args()
    env = stack_env()
    creds = registry_credentials(env)
    host = DockerHost(base_url=env["DOCKER_HOST"])
    image = DockerImageBuilder(
        docker_host=host,
        credentials=creds,
        repository="gpuferry/bench-canary",
        build_args={"BASE_IMAGE": env["BASE_IMAGE"]},
    ).build(load_workload(str(ROOT / "examples/diabetes")))
    models = canary_models(Path(tempfile.mkdtemp(prefix="gpuferry-bench-canary-")))
    serving = DockerServing(
        docker_host=host, registry_credentials=creds, drain_seconds=5, env={"WARMUP_ITERATIONS": "1"}
    )
    service = f"bench-canary-{uuid.uuid4().hex[:6]}"
    policy = RolloutPolicy(strategy="canary", share=args.share, window_seconds=args.window, min_requests=20)

    def spec(rollout: RolloutPolicy | None) -> ServingSpec:
        smoke = {"dataframe_records": [{"x": 1.0}]}
        return ServingSpec(service_name=service, smoke_request=smoke, ready_timeout_seconds=300, rollout=rollout)

    def release(version: str, model: str) -> Release:
        return Release(model_name="bench", version=version, model_uri=models[model], image=image, server=ServerSpec())

    try:
        first = serving.deploy(spec(None), release("1", "good"))
        with SteadyLoad(first.url, args.rate) as load:
            time.sleep(2)
            try:
                serving.deploy(spec(policy), release("2", "failing"))
                raise SystemExit("the failing canary passed")
            except CanaryFailed as exc:
                failed = exc.numbers
            passed = serving.deploy(spec(policy), release("3", "good")).detail["rollout"]
            time.sleep(2)
        undelivered = sum(1 for s in load.statuses if s in (0, 502, 503))
        share = passed["candidate_requests"] / (passed["candidate_requests"] + passed["current_requests"])
        print(
            f"requests sent: {len(load.statuses)} at {args.rate:g}/s; the failing canary's own 400s: "
            f"{load.statuses.count(400)}; other: {sorted(set(load.statuses) - {200, 400})}"
        )
        print(f"failing canary: {failed}")
        print(f"passing canary: {passed}")
        print(f"RESULT R1_failed_client_requests {undelivered}")
        print(f"RESULT R2_canary_share {share:.4f}")
        print(f"RESULT R3_decision_s {max(failed['decision_s'], passed['decision_s']):.3f}")
    finally:
        serving.undeploy(service)


if __name__ == "__main__":
    main()
