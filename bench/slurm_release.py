"""How releasing a held job array affects Slurm's throughput (what P1_vs_floor depends on).

1000 trivial tasks (``echo``), one array per run, on the local Slurm (``make slurm-up``, idempotent):

* plain: ``sbatch --array`` (never held);
* whole: submitted ``--hold``, then one ``scontrol release <array>``;
* parts: submitted ``--hold``, then released 40 tasks at a time every 0.8 s (25 parts). Each task
  released by its index becomes a job record of its own, which Slurm schedules apart from the
  array's one record;
* doubling: submitted ``--hold``, then parts of 16, 16, 32, 64, … tasks every 0.8 s while they are
  less than half the array, then the rest as the whole array.

The sweep flow releases its first 16 tasks by index, then the rest as the whole array.

Each run polls one ``squeue --local -j`` a second until every task is COMPLETED and prints the wall
time from submit. Runs follow one another as soon as nothing is queued, while the controller still
keeps the earlier runs' finished records (MinJobAge, 300 s), which slow every later run: compare
modes within a round, and over rounds.

    .venv/bin/python bench/slurm_release.py [--n 1000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", default="plain,whole,parts,doubling", help="comma-separated, run in this order")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(REPO), "slurm-up"], check=True, stdout=subprocess.DEVNULL)
    from tests.private_worker import wait_until
    from tests.stacks import stack_env

    env = {**os.environ, "SLURM_CONF": stack_env("slurm")["SLURM_CONF"]}

    def sh(*argv: str) -> str:
        return subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout

    def completed(job: str) -> int:
        out = sh("squeue", "--local", "-h", "-t", "all", "-j", job, "-O", "ArrayTaskID:|,State:|")
        return sum(1 for line in out.splitlines()
                   if line.split("|")[0].strip().isdigit() and line.split("|")[1].strip() == "COMPLETED")  # fmt: skip

    def one(mode: str) -> float:
        wait_until("the previous run's tasks to leave the queue",
                   lambda: not sh("squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING").strip(), timeout=600, interval=1)  # fmt: skip
        start = time.perf_counter()
        argv = ["sbatch", "--parsable", f"--array=0-{args.n - 1}", "--time=5", "--output=/dev/null", "--wrap", "echo"]
        if mode != "plain":
            argv.insert(2, "--hold")
        job = sh(*argv).strip().split(";")[0]
        if mode == "whole":
            sh("scontrol", "release", job)
        elif mode == "parts":
            for first in range(0, args.n, 40):
                sh("scontrol", "release", ",".join(f"{job}_{i}" for i in range(first, min(args.n, first + 40))))
                time.sleep(0.8)
        elif mode == "doubling":
            released = 0
            while 2 * max(released, 8) < args.n:
                size = max(16, released)
                sh("scontrol", "release", f"{job}_[{released}-{released + size - 1}]")
                released += size
                time.sleep(0.8)
            # The tasks released by index that already ran answer "Job has already finished" (exit 1);
            # any other answer is an error.
            done = subprocess.run(["scontrol", "release", job], env=env, capture_output=True, text=True)
            other = [line for line in (done.stdout + done.stderr).splitlines()
                     if line.strip() and not line.rstrip().endswith(("Job has already finished", "No error"))]  # fmt: skip
            if done.returncode != 0 and other:
                raise RuntimeError(f"scontrol release {job}: " + "; ".join(other))
        wait_until(f"all {args.n} tasks of {mode} array {job} COMPLETED", lambda: completed(job) >= args.n,
                   timeout=900, interval=1)  # fmt: skip
        return time.perf_counter() - start

    walls: dict[str, list[float]] = {mode: [] for mode in args.modes.split(",")}
    for _ in range(args.repeat):
        for mode in walls:
            walls[mode].append(one(mode))
            print(f"{mode:6s} N={args.n}: {walls[mode][-1]:.1f} s", flush=True)
    for mode, values in walls.items():
        print(f"{mode}: " + " / ".join(f"{v:.1f}" for v in values) + " s")


if __name__ == "__main__":
    main()
