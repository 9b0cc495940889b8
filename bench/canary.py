"""R: a canary under a steady client load, on the Docker backend or on Kubernetes: one that fails its requests,
then a healthy one, through the service's address.

Against the registry stack's engine (podman's Docker API; the script runs `make registry-up`, idempotent): the
diabetes example's image serves two pyfunc models, y = 2x, one of which raises on every x that is a multiple of
5 (its answers are 400s, as MLflow's server answers a model's error). v1 (healthy) serves; clients send x
drawn from 1..5 at a steady rate; v2 (failing) is deployed as a canary at ``--share`` for ``--window`` seconds,
then v3 (healthy) the same way. Peers: KServe moves canary traffic but promotion and rollback are manual (its
maintainers point to Argo Rollouts), SkyServe and dstack do rolling or blue-green updates without a verdict;
none runs here, so there is no side-by-side figure, only ours against the goals.

``--backend kubernetes``: on the k8s stack's node (`make registry-up k8s-up`, run by the script), the digits
example's image serving the same models from a host directory, two serving replicas; the canary is a Deployment
of its own that the serving pods route the share to. The load comes from inside the node through the Service's
ClusterIP, on one keep-alive client (a Service balances connections, so only a per-request split gives the
share), always x = 5: the failing version fails every request it gets.

Prints ``RESULT R1_failed_client_requests`` (requests the service did not deliver to a version: no answer, or
the front's 502/503, over both canaries; goal 0), ``RESULT R2_canary_share`` (the share of the window's requests
the passing canary answered, from both versions' own /metrics; goal: the policy's share ± 0.03), ``RESULT
R3_decision_s`` (window end → verdict applied: the front on one version again; the larger of the two; goal
≤ 10) and the figures.

    .venv/bin/python bench/canary.py [--backend docker|kubernetes] [--share 0.1] [--window 30] [--rate 40]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

SMOKE = {"dataframe_records": [{"x": 1.0}]}


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


def on_docker(args: argparse.Namespace, models: dict[str, str]) -> tuple[list[int], dict, dict]:
    """Both canaries on the Docker backend, behind its front; the load from this machine."""
    env = stack_env()
    creds = registry_credentials(env)
    host = DockerHost(base_url=env["DOCKER_HOST"])
    image = DockerImageBuilder(
        docker_host=host,
        credentials=creds,
        repository="gpuferry/bench-canary",
        build_args={"BASE_IMAGE": env["BASE_IMAGE"]},
    ).build(load_workload(str(ROOT / "examples/diabetes")))
    serving = DockerServing(
        docker_host=host, registry_credentials=creds, drain_seconds=5, env={"WARMUP_ITERATIONS": "1"}
    )
    service = f"bench-canary-{uuid.uuid4().hex[:6]}"
    policy = RolloutPolicy(strategy="canary", share=args.share, window_seconds=args.window, min_requests=20)

    def spec(rollout: RolloutPolicy | None) -> ServingSpec:
        return ServingSpec(service_name=service, smoke_request=SMOKE, ready_timeout_seconds=300, rollout=rollout)

    def release(version: str, model: str) -> Release:
        return Release(model_name="bench", version=version, model_uri=models[model], image=image, server=ServerSpec())

    try:
        first = serving.deploy(spec(None), release("1", "good"))
        with SteadyLoad(first.url, args.rate) as load:
            time.sleep(2)
            failed, passed = both_canaries(lambda policy, v, m: serving.deploy(spec(policy), release(v, m)), policy)
            time.sleep(2)
        return list(load.statuses), failed, passed
    finally:
        serving.undeploy(service)


def on_kubernetes(args: argparse.Namespace, models: dict[str, str], root: Path) -> tuple[list[int], dict, dict]:
    """Both canaries on the k8s stack's node: two serving replicas routing the share to the canary's own
    Deployment; the load through the Service's ClusterIP from inside the node, on one keep-alive client."""
    subprocess.run(["make", "-s", "registry-up", "k8s-up"], cwd=ROOT, check=True, stdout=sys.stderr)
    from bench.k8s_rollout import bench_namespace
    from blocks.records import ImageRef
    from tests.examples import DIGITS
    from tests.k8s_node import ServiceLoad
    from tests.private_worker import wait_until
    from tests.stacks import stack_env as stack

    k8s, reg = stack("k8s"), stack_env()
    builder = DockerImageBuilder(
        docker_host=DockerHost(base_url=reg["DOCKER_HOST"]),
        credentials=registry_credentials(reg),
        repository="gpuferry/workload",
        build_args={"BASE_IMAGE": reg["BASE_IMAGE"]},
    )
    reference = builder.build(load_workload(str(DIGITS))).reference
    image = ImageRef(builder="docker", content_tag="bench", reference=reference, built=True)
    for p in (root, *root.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    in_pods = {name: f"file:///models/{Path(uri).name}" for name, uri in models.items()}
    with bench_namespace(k8s, reg, root, env={"WARMUP_ITERATIONS": "1", "MODEL_DEVICE": "cpu"}) as block:
        policy = RolloutPolicy(strategy="canary", share=args.share, window_seconds=args.window, min_requests=20)

        def spec(rollout: RolloutPolicy | None) -> ServingSpec:
            return ServingSpec(
                service_name="bench", smoke_request=SMOKE, replicas=2, ready_timeout_seconds=300, rollout=rollout
            )

        def release(version: str, model: str) -> Release:
            return Release(model_name="bench", version=version, model_uri=in_pods[model], image=image)

        block.deploy(spec(None), release("1", "good"))
        svc = block._api().get(f"/api/v1/namespaces/{block.namespace}/services/bench")
        url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
        body = {"dataframe_records": [{"x": 5.0}]}  # the failing version fails every request it gets
        load = ServiceLoad(k8s["K8S_NODE_NETNS"], url, body, rate=args.rate, max_requests=10**6, max_seconds=1800)
        load.start()
        try:
            wait_until("the load's first answers", lambda: len(load.answers) >= 10, timeout=120, interval=0.2)
            failed, passed = both_canaries(lambda policy, v, m: block.deploy(spec(policy), release(v, m)), policy)
            time.sleep(2)
        finally:
            answers = load.stop()
        return [a.status or 0 for a in answers], failed, passed


def both_canaries(deploy: Callable[[RolloutPolicy | None, str, str], Any], policy: RolloutPolicy) -> tuple[dict, dict]:
    """v2 (failing) as a canary, which must fail, then v3 (healthy), which must pass: what each measured."""
    try:
        deploy(policy, "2", "failing")
        raise SystemExit("the failing canary passed")
    except CanaryFailed as exc:
        failed = exc.numbers
    passed = deploy(policy, "3", "good").detail["rollout"]
    return failed, passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("docker", "kubernetes"), default="docker", help="where it serves")
    parser.add_argument("--share", type=float, default=0.1, help="the canary's share of the requests")
    parser.add_argument("--window", type=float, default=30, help="the canary's window, seconds")
    parser.add_argument("--rate", type=float, default=40, help="client requests a second")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpuferry-bench-canary-"))
    models = canary_models(root)
    if args.backend == "docker":
        statuses, failed, passed = on_docker(args, models)
    else:
        statuses, failed, passed = on_kubernetes(args, models, root)
    undelivered = sum(1 for s in statuses if s in (0, 502, 503))
    share = passed["candidate_requests"] / (passed["candidate_requests"] + passed["current_requests"])
    print(
        f"{args.backend}: requests sent: {len(statuses)} at {args.rate:g}/s; the failing canary's own 400s: "
        f"{statuses.count(400)}; other: {sorted(set(statuses) - {200, 400})}"
    )
    print(f"failing canary: {failed}")
    print(f"passing canary: {passed}")
    print(f"RESULT R1_failed_client_requests {undelivered}")
    print(f"RESULT R2_canary_share {share:.4f}")
    print(f"RESULT R3_decision_s {max(failed['decision_s'], passed['decision_s']):.3f}")


if __name__ == "__main__":
    main()
