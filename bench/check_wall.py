"""`gpuferry check` on the local stacks: the wall time of the command as a user runs it (goal ≤ 10 s).

Runs the installed command, `.venv/bin/gpuferry check -f stack.yaml --workload house-prices --json`, N times
on a stack file for the local stacks (tests/stack_files.py: Slurm over SSH, the registry and podman, S3,
MLflow, Kubernetes) with the Prefect stack's server, its pool and worker, and a workload from `gpuferry init`:
the README's `gpuferry check hpc --workload house-prices`, unsaved (`-f`). The default deadline (10 s per
backend). It starts nothing: the stacks must be up (`make stacks-up`); a missing one stops it naming the
command that starts it. It makes a bucket of its own for the S3 checks and removes it at the end.

    .venv/bin/python bench/check_wall.py [--runs 5]

Each run: the wall time from exec to exit (Python's start and imports included), the seconds the command
reports for its checks (from its start to its verdict), and the backend that took longest (the sum of its
checks). The 1-minute load average is sampled before each run. A run with a failed check stops the benchmark.

Python's bytecode cache: an installed package has its modules compiled (pip does it at install time), so the
measured runs read compiled modules from a cache of the benchmark's own (PYTHONPYCACHEPREFIX, in a temporary
directory; nothing is written into the environment), which one run before them fills. That first run is
printed apart: it is what a start without a bytecode cache costs (as with PYTHONDONTWRITEBYTECODE=1 and no
caches), about a thousand modules compiled from source.

Prints ``RESULT check_wall_s <median>``, ``RESULT check_inner_s <median>`` and ``RESULT check_load1_median
<load>`` (with the minimum and maximum of each). Goal: check_wall_s ≤ 10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.stacks import stacks_root

STACKS = ("slurm", "registry", "s3", "mlflow", "k8s", "prefect")


def spread(values: list[float]) -> str:
    return f"(min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    missing = [n for n in STACKS if not (stacks_root() / n / "env").exists()]
    if missing:
        print(
            f"the {', '.join(missing)} stack(s) are not up: `make {' '.join(f'{n}-up' for n in missing)}`",
            file=sys.stderr,
        )
        return 2

    from deployments import skeleton
    from tests.stack_files import S3_SECRET_ENV, local_stack, write
    from tests.stacks import s3_store, stack_env

    store = s3_store(f"gpuferry-bench-check-{uuid.uuid4().hex[:8]}")
    bucket = store.bucket.bucket_name
    walls: list[float] = []
    inner: list[float] = []
    loads: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gpuferry-check-bench-") as tmp:
            path = write(Path(tmp) / "stack.yaml", {"hpc": local_stack(bucket)})
            skeleton.write(Path(tmp) / "house-prices")
            env = {
                **os.environ,
                S3_SECRET_ENV: stack_env("s3")["AWS_SECRET_ACCESS_KEY"],
                "PREFECT_API_URL": stack_env("prefect")["PREFECT_API_URL"],
                "PYTHONPATH": str(REPO),
                "PYTHONPYCACHEPREFIX": str(Path(tmp) / "pycache"),
            }
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            command = [
                str(REPO / ".venv/bin/gpuferry"),
                "check",
                "-f",
                str(path),
                "--workload",
                "house-prices",
                "--json",
            ]
            for i in range(args.runs + 1):
                load = os.getloadavg()[0]
                started = time.monotonic()
                done = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
                wall = time.monotonic() - started
                if done.returncode != 0:
                    print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
                    print(f"run {i}: gpuferry check exited {done.returncode}: fix the stacks first", file=sys.stderr)
                    return 1
                report = json.loads(done.stdout)
                per_step: dict[str, float] = {}
                for row in report["rows"]:
                    per_step[row["step"]] = per_step.get(row["step"], 0.0) + row["seconds"]
                slowest = max(per_step, key=per_step.__getitem__)
                what = "without a bytecode cache (compiling, not counted)" if i == 0 else f"run {i}"
                print(
                    f"{what}: {wall:.2f} s wall, {report['seconds']:.2f} s checks, {len(report['rows'])} checks, "
                    f"slowest {slowest} {per_step[slowest]:.2f} s, load {load:.2f}",
                    flush=True,
                )
                if i > 0:
                    walls.append(wall)
                    inner.append(float(report["seconds"]))
                    loads.append(load)
    finally:
        client = store.bucket.credentials.get_s3_client()
        for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=item["Key"])
        client.delete_bucket(Bucket=bucket)
    print(f"RESULT check_wall_s {statistics.median(walls):.2f} {spread(walls)}")
    print(f"RESULT check_inner_s {statistics.median(inner):.2f} {spread(inner)}")
    print(f"RESULT check_load1_median {statistics.median(loads):.2f} {spread(loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
