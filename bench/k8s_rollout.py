"""K1/K2: a new model version on the local Kubernetes node, under a steady load through the Service.

Starts the registry and k8s stacks itself (`make registry-up k8s-up`, idempotent), builds and pushes the
workload image (a tag hit when unchanged), and serves small checkpoints from a host directory mounted into
the pods. Two services of 2 replicas each, side by side in one namespace, go through the same steps:

- ours: ``KubernetesCluster.deploy`` of v1, then of v2 (rolling update: rollout watch, smoke request through
  the API server), then of a v3 whose smoke request fails (its pods become ready and take traffic, then the
  block rolls back to v2);
- peer: ``kubectl apply -f`` of the same objects (``blocks/kubernetes/manifests.py``) + ``kubectl rollout status``
  for v1, v2 and v3, then ``kubectl rollout undo`` + ``kubectl rollout status`` back to v2.

A load from inside the node's network namespace (``tests/k8s_node.ServiceLoad``: 20 requests a second on
one keep-alive client, ``POST /invocations`` alternating with ``GET /``, which names the model that answered)
runs on each Service through all of it, bounded in count and time. Prints, per side:

    RESULT K1_<side>_deploy_s     v2's deploy call: start -> returned (rollout done; ours: + smoke test)
    RESULT K1_<side>_serving_s    v2's deploy start -> the first answer of v2 through the Service
    RESULT K1_<side>_all_new_s    v2's deploy start -> the first answer after which only v2 answers
    RESULT K2_<side>_requests     requests sent over the whole run
    RESULT K2_<side>_failed       of those, failed (no answer or not 200): the goal is 0

    .venv/bin/python bench/k8s_rollout.py [--rate 20] [--stacks-up]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost
from pydantic import SecretStr

from blocks.base.serving import Release
from blocks.docker.image import DockerImageBuilder
from blocks.errors import RolledBack
from blocks.kubernetes import manifests as m
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.records import ImageRef
from blocks.specs import ServingSpec
from blocks.workload.source import load_workload
from tests.examples import DIGITS
from tests.k8s_node import PULL_SECRET, ServiceLoad, pods, pull_secret, write_test_models
from tests.private_worker import wait_until
from tests.stacks import stack_env

HIDDEN = {"1": 16, "2": 24, "3": 32}
MODELS: dict[str, int] = {}  # each test model's sha256 (what GET / names) -> its hidden width


def uri(version: str) -> str:
    return f"file:///models/model-{HIDDEN[version]}"


def timeline(load: ServiceLoad, started: float, version: str) -> tuple[float, float]:
    """Seconds from ``started`` (on the load's clock) to the first answer of ``version``, and to the first
    answer after which only ``version`` answers."""
    seen = [(at, u) for at, u in load.models() if at >= started]
    first = next(at for at, sha in seen if MODELS[sha] == HIDDEN[version])
    last_other = max((at for at, sha in seen if MODELS[sha] != HIDDEN[version]), default=started)
    all_new = next(at for at, u in seen if at > last_other)
    return first - started, all_new - started


class Side:
    def __init__(self, name: str, block: KubernetesCluster, k8s: dict[str, str], image: str, rate: float) -> None:
        self.name, self.block, self.k8s, self.image, self.rate = name, block, k8s, image, rate
        self.spec = ServingSpec(service_name=f"bench-{name}", replicas=2, smoke_request={"inputs": [[0.0] * 64]})
        self.obj = m.service_object_name(self.spec)

    def release(self, version: str) -> Release:
        return Release(
            model_name="digits-mlp",
            version=version,
            model_uri=uri(version),
            image=ImageRef(builder="docker", content_tag=version, reference=self.image, built=True),
        )

    def start_load(self) -> ServiceLoad:
        svc = self.block._api().get(f"/api/v1/namespaces/{self.block.namespace}/services/{self.obj}")
        url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
        load = ServiceLoad(
            self.k8s["K8S_NODE_NETNS"],
            url,
            {"inputs": [[0.5] * 64]},
            rate=self.rate,
            max_requests=int(self.rate * 600),
            max_seconds=600,
        ).start()
        wait_until("the load's first answers", lambda: len(load.answers) >= 10, timeout=120, interval=0.2)
        return load

    def settle(self, load: ServiceLoad, version: str) -> None:
        """Wait until no pod of another version is left, then for 20 more answers."""

        def only() -> bool:
            return all(
                p["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == version for p in pods(self.block, self.obj)
            )

        wait_until(f"{self.name}: only v{version} pods", only, timeout=300, interval=0.5)
        count = len(load.answers)
        wait_until("20 more answers", lambda: len(load.answers) >= count + 20, timeout=120, interval=0.2)

    def kubectl(self, *args: str) -> None:
        cmd = [self.k8s["K8S_KUBECTL"], "--kubeconfig", self.k8s["KUBECONFIG"], "-n", self.block.namespace, *args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)

    def peer_apply(self, version: str, workdir: Path) -> None:
        objects = m.build_manifests(
            self.spec,
            model_name="digits-mlp",
            version=version,
            model_uri=uri(version),
            image=self.image,
            opts=self.block._options(**self.block._discover_versions()),
        )
        path = workdir / f"{self.obj}-v{version}.json"
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects.values())}))
        self.kubectl("apply", "-f", str(path))
        self.kubectl("rollout", "status", f"deployment/{self.obj}", "--timeout=300s")

    def run(self, workdir: Path) -> dict[str, Any]:
        ours = self.name == "ours"

        def deploy(version: str) -> None:
            if ours:
                self.block.deploy(self.spec, self.release(version))
            else:
                self.peer_apply(version, workdir)

        deploy("1")
        load = self.start_load()
        clock0 = load.t0
        try:
            self.settle(load, "1")
            started = time.monotonic() - clock0
            deploy("2")
            deploy_s = time.monotonic() - clock0 - started
            self.settle(load, "2")
            serving_s, all_new_s = timeline(load, started, "2")
            if ours:  # v3 fails its smoke test after taking traffic: the block rolls back
                bad = self.spec.model_copy(update={"smoke_request": {"inputs": [[0.0, 1.0, 2.0]]}})
                try:
                    self.block.deploy(bad, self.release("3"))
                    raise AssertionError("v3 was not rolled back")
                except RolledBack:
                    pass
            else:
                deploy("3")
                self.kubectl("rollout", "undo", f"deployment/{self.obj}")
                self.kubectl("rollout", "status", f"deployment/{self.obj}", "--timeout=300s")
            self.settle(load, "2")
        finally:
            answers = load.stop()
        failed = load.failed
        print(
            f"# {self.name}: v2 deploy {deploy_s:.1f} s, first v2 answer {serving_s:.1f} s, only v2 from "
            f"{all_new_s:.1f} s; {len(answers)} requests, {len(failed)} failed "
            f"{[a.error or a.status for a in failed[:3]]}",
            file=sys.stderr,
        )
        return {
            "deploy_s": deploy_s,
            "serving_s": serving_s,
            "all_new_s": all_new_s,
            "requests": len(answers),
            "failed": len(failed),
        }


@contextmanager
def bench_namespace(
    k8s: dict[str, str], reg: dict[str, str], models: Path, **fields: Any
) -> Iterator[KubernetesCluster]:
    """A namespace of its own on the k8s stack, with the registry stack's pull secret, and a block serving there
    with ``models`` mounted at /models in every pod (``fields`` over the block's settings); deleted at the end."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    kubeconfig = SecretStr(Path(k8s["KUBECONFIG"]).read_text())
    api = KubernetesCluster(kubeconfig=kubeconfig)._api()
    api.request(
        "POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    )
    try:
        api.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body=pull_secret(reg))
        settings: dict[str, Any] = {
            "cpu_request": "10m",
            "memory_request": "64Mi",
            "image_pull_secret": PULL_SECRET,
            "host_path_mounts": {str(models): "/models"},
            "env": {"WARMUP_ITERATIONS": "1"},
            "rollout_timeout_seconds": 300,
            **fields,
        }
        yield KubernetesCluster(kubeconfig=kubeconfig, namespace=namespace, **settings)
    finally:
        api.delete(f"/api/v1/namespaces/{namespace}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second of each load")
    parser.add_argument("--stacks-up", action="store_true", help="the stacks are up already: do not start them")
    args = parser.parse_args()
    if not args.stacks_up:
        subprocess.run(["make", "-s", "registry-up", "k8s-up"], cwd=ROOT, check=True, stdout=sys.stderr)
    k8s, reg = stack_env("k8s"), stack_env("registry")
    image = (
        DockerImageBuilder(
            docker_host=DockerHost(base_url=reg["DOCKER_HOST"]),
            credentials=DockerRegistryCredentials(
                username=reg["REGISTRY_USER"],
                password=Path(reg["REGISTRY_PASSWORD_FILE"]).read_text().strip(),
                registry_url=f"http://{reg['REGISTRY_URL']}",
            ),
            repository="gpuferry/workload",
            build_args={"BASE_IMAGE": reg["BASE_IMAGE"]},
        )
        .build(load_workload(str(DIGITS)))
        .reference
    )
    with tempfile.TemporaryDirectory(prefix="gpuferry-bench-k8s-") as tmp:
        work = Path(tmp)
        (work / "models").mkdir()
        MODELS.update(write_test_models(work / "models", tuple(HIDDEN.values())))
        Path(tmp).chmod(0o755)
        with bench_namespace(k8s, reg, work / "models") as block:
            results = {side: Side(side, block, k8s, image, args.rate).run(work) for side in ("ours", "peer")}
    for side, r in results.items():
        print(f"RESULT K1_{side}_deploy_s {r['deploy_s']:.2f}")
        print(f"RESULT K1_{side}_serving_s {r['serving_s']:.2f}")
        print(f"RESULT K1_{side}_all_new_s {r['all_new_s']:.2f}")
        print(f"RESULT K2_{side}_requests {r['requests']}")
        print(f"RESULT K2_{side}_failed {r['failed']}")


if __name__ == "__main__":
    main()
