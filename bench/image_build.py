"""P7: the image step when nothing changed (content-tag hit in the registry) vs a full build of the same image.

Both run in this one process against the registry stack, which this script starts itself
(`make registry-up`, idempotent):

- tag hit: ``DockerImageBuilder.build()`` of the unchanged digits example (examples/digits) whose tag is already
  in the registry — pack and hash the context, one HEAD to the registry, no engine call. Median of several runs.
- full build: the same Dockerfile, context and base, built without the layer cache (``nocache=True``) into a
  throwaway repository, pushed, digest read back — what a pipeline without content tags pays every run.

Prints ``RESULT P7 <tag hit / full build>`` (goal ≤ 0.05) plus the two times. The throwaway repository's
manifest is deleted from the registry afterwards and its local tag removed.

    .venv/bin/python bench/image_build.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import docker
import httpx
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost

from blocks.docker.image import DockerImageBuilder
from blocks.docker.registry import MANIFEST_TYPES
from blocks.workload.source import load_workload

WORKLOAD = ROOT / "examples" / "digits"


def stack_env() -> dict[str, str]:
    subprocess.run(["make", "-s", "registry-up"], cwd=ROOT, check=True, stdout=sys.stderr)
    cache = Path(os.environ.get("GPUFERRY_CACHE", Path.home() / ".cache" / "gpuferry"))
    path = Path(os.environ.get("GPUFERRY_STACKS", cache / "stacks")) / "registry" / "env"
    env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    env["REGISTRY_PASSWORD"] = Path(env["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    return env


def registry_credentials(env: dict[str, str]) -> DockerRegistryCredentials:
    """The login to the registry stack (``stack_env``'s settings)."""
    return DockerRegistryCredentials(
        username=env["REGISTRY_USER"], password=env["REGISTRY_PASSWORD"], registry_url=f"http://{env['REGISTRY_URL']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="tag-hit runs (the median is reported)")
    args = parser.parse_args()

    env = stack_env()
    creds = registry_credentials(env)

    def builder(repository: str, **kwargs: object) -> DockerImageBuilder:
        return DockerImageBuilder(
            docker_host=DockerHost(base_url=env["DOCKER_HOST"]),
            credentials=creds,
            repository=repository,
            build_args={"BASE_IMAGE": env["BASE_IMAGE"]},
            **kwargs,
        )

    # Make sure the tag is there (builds once when the example changed since the last run; not timed).
    workload = load_workload(str(WORKLOAD))
    started = time.monotonic()
    first = builder("gpuferry/workload").build(workload)
    print(
        f"# setup: {first.reference} ({'built' if first.built else 'already pushed'}, "
        f"{time.monotonic() - started:.1f}s)",
        file=sys.stderr,
    )

    hits = []
    for _ in range(args.repeats):
        started = time.monotonic()
        image = builder("gpuferry/workload").build(load_workload(str(WORKLOAD)))
        hits.append(time.monotonic() - started)
        assert not image.built and image.reference == first.reference, image
    hit = statistics.median(hits)

    throwaway = f"gpuferry-bench/full-{uuid.uuid4().hex[:10]}"
    full_builder = builder(throwaway, nocache=True)
    started = time.monotonic()
    full = full_builder.build(workload)
    full_s = time.monotonic() - started
    assert full.built, full

    # Clean up the throwaway repository: its manifest in the registry and its local tag.
    digest = full.reference.split("@")[1]
    httpx.delete(
        f"http://{env['REGISTRY_URL']}/v2/{throwaway}/manifests/{digest}",
        headers={"Accept": MANIFEST_TYPES},
        auth=(env["REGISTRY_USER"], env["REGISTRY_PASSWORD"]),
        timeout=30,
    )
    client = docker.DockerClient(base_url=env["DOCKER_HOST"])
    try:
        client.images.remove(f"{full_builder.image_name()}:{full.content_tag}")
    finally:
        client.close()

    print(f"# tag hit: median {hit:.3f}s of {[round(h, 3) for h in hits]}; full build + push: {full_s:.1f}s")
    print(f"RESULT P7_tag_hit_s {hit:.4f}")
    print(f"RESULT P7_full_build_s {full_s:.2f}")
    print(f"RESULT P7 {hit / full_s:.4f}")


if __name__ == "__main__":
    main()
