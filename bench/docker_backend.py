"""P9: DockerCompute's submit-to-running and end-to-end time of a short job vs a plain `docker run` of the same
image on the same engine.

Both run against the registry stack's engine (podman's Docker API; the script starts the stack itself with
`make registry-up`, idempotent), alternating round by round so that the machine's load hits both alike:

- ours: ``DockerCompute.submit(job)`` (a fresh block each round, as a flow run gets one: validation, the lookup
  by label/name, the image check, the GPU claims, create, start) until it returns with the container running;
  end to end: submit, ``watch`` until COMPLETED (the default poll interval), ``result`` (log and exit saved,
  container removed);
- plain: the docker CLI, ``docker run -d`` (submit-to-running) and ``docker run --rm`` (end to end) of the same
  image, command, network and bind mount.

The job prints one line (``python -c``) in the digits example's image. Also reported: ours with one stand-in
GPU (CDI device, see tests/fake_gpus.py; the plain CLI cannot pass one through podman's Docker API), which adds
the GPU choice and the check that no racing container claims the same GPU.

Prints ``RESULT P9_start_ratio <ours / plain, submit-to-running medians>`` (goal ≤ 1.2), ``RESULT P9_e2e_ratio``
and the figures. Every container and job directory it makes is removed; the CDI spec file too.

    .venv/bin/python bench/docker_backend.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefect_docker.host import DockerHost

from bench.image_build import registry_credentials, stack_env  # `make registry-up`, then its settings
from blocks.docker.compute import DockerCompute
from blocks.docker.image import DockerImageBuilder
from blocks.local.provider import LocalMachine
from blocks.records import TrainingJob
from blocks.specs import Resources
from blocks.workload.source import load_workload
from tests.fake_gpus import fake_gpus

COMMAND = ["python", "-c", "print('hello from the job')"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each side (medians are reported)")
    args = parser.parse_args()
    env = stack_env()
    creds = registry_credentials(env)
    host = DockerHost(base_url=env["DOCKER_HOST"])
    image = DockerImageBuilder(
        docker_host=host,
        credentials=creds,
        repository="gpuferry/workload",
        build_args={"BASE_IMAGE": env["BASE_IMAGE"]},
    ).build(load_workload(str(ROOT / "examples/digits")))
    assert image.reference
    cli_env = {**os.environ, "DOCKER_HOST": env["DOCKER_HOST"]}
    root = Path(tempfile.mkdtemp(prefix="gpuferry-bench-docker-"))
    made: list[str] = []
    figures: dict[str, list[float]] = {
        k: [] for k in ("ours_start", "ours_e2e", "plain_start", "plain_e2e", "ours_gpu_start", "ours_gpu_e2e")
    }
    try:
        with fake_gpus(root / "gpus", count=1) as gpus:
            inventory = LocalMachine(nvidia_smi=gpus.nvidia_smi, nvidia_ctk="/nonexistent").host_inventory()

            def ours(gpu: bool) -> tuple[float, float]:
                block = DockerCompute(
                    docker_host=host, registry_credentials=creds, cdi_kind=gpus.kind, workdir_root=str(root / "jobs")
                ).with_inventory(inventory)
                key = f"bench-{uuid.uuid4().hex[:8]}"
                made.append(f"gpuferry-job-{key}")
                job = TrainingJob(
                    key=key,
                    workdir=block.job_workdir(key),
                    image=image,
                    command=COMMAND,
                    resources=Resources(gpus_per_node=1 if gpu else 0),
                )
                started = time.perf_counter()
                handle = block.submit(job)
                running = time.perf_counter() - started
                status = block.watch(handle, timeout_seconds=300)
                block.result(handle, status)
                return running, time.perf_counter() - started

            def plain() -> tuple[float, float]:
                workdir = root / "plain" / uuid.uuid4().hex[:8]
                workdir.mkdir(parents=True)
                run = ["docker", "run", "--network", "host", "-v", f"{workdir}:{workdir}", "-w", "/workload"]
                name = f"gpuferry-bench-plain-{uuid.uuid4().hex[:8]}"
                made.append(name)
                started = time.perf_counter()
                subprocess.run(
                    [*run, "-d", "--name", name, image.reference, *COMMAND],
                    env=cli_env,
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
                running = time.perf_counter() - started
                for step in (["wait", name], ["rm", name]):  # after it exited: rm -f racing the exit can fail
                    subprocess.run(["docker", *step], env=cli_env, check=True, capture_output=True, timeout=300)
                started = time.perf_counter()
                subprocess.run(
                    [*run, "--rm", image.reference, *COMMAND], env=cli_env, check=True, capture_output=True, timeout=300
                )
                return running, time.perf_counter() - started

            ours(False), plain()  # warm-up (image lookups, the CLI's first start), not counted
            for round_ in range(args.rounds):
                sides = [("ours", lambda: ours(False)), ("plain", plain), ("ours_gpu", lambda: ours(True))]
                for name, side in sides if round_ % 2 == 0 else reversed(sides):
                    start, e2e = side()
                    figures[f"{name}_start"].append(start)
                    figures[f"{name}_e2e"].append(e2e)
    finally:
        for name in made:
            subprocess.run(["docker", "rm", "-f", name], env=cli_env, capture_output=True, timeout=300)
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in figures.items()}
    load = os.getloadavg()[0]
    print(f"RESULT P9_start_ratio {med['ours_start'] / med['plain_start']:.3f}")
    print(f"RESULT P9_e2e_ratio {med['ours_e2e'] / med['plain_e2e']:.3f}")
    for key in ("ours_start", "plain_start", "ours_e2e", "plain_e2e", "ours_gpu_start", "ours_gpu_e2e"):
        print(f"RESULT P9_{key}_s {med[key]:.3f}")
    print(
        f"# medians of {args.rounds} rounds each, load {load:.1f}; all rounds: "
        + "; ".join(f"{k} " + ",".join(f"{x:.2f}" for x in v) for k, v in figures.items())
    )


if __name__ == "__main__":
    main()
