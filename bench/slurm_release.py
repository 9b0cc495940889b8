"""How releasing a held job array affects Slurm's throughput (what P1_vs_floor depends on).

1000 trivial tasks (``echo``), one array per run, on the local Slurm (``make slurm-up``, idempotent).
The sweep flow may release a task only once its MLflow child run exists; here the runs are
emulated: ``--rate`` of them are "made" each second from submit on (a local SQLite store makes
~150 a second on an idle machine, ~60 while the P1 sweep's tasks share it), and each mode
releases what is made by then:

* plain: ``sbatch --array`` (never held; the floor);
* whole: submitted ``--hold``, then one ``scontrol release <array>`` at once (as if runs were free);
* split: submitted ``--hold``, then every task released by its index in one command, then the
  array: each task released by index becomes a job record of its own; this shows what that costs;
* late: the first 16 tasks by index once made, the rest as the whole array once every run is made;
* parts: every 0.1 s, the tasks made since, by index (many releases); the rest as the array;
* doubling: the sweep flow's own policy, run as it is (tasks/sweep.py ``_release_as_runs_come``, fed
  the emulated runs in index order): a part by index once the made and held tasks number at least 16
  and at least all the parts before; the rest as the array.

Each run polls one ``squeue --local -j`` a second until every task is COMPLETED and prints the wall
time from submit. Runs follow one another as soon as nothing is queued, while the controller still
keeps the earlier runs' finished records (MinJobAge, 300 s), which slow every later run: the modes
run in the given order, then in the reverse order (``--repeat`` such pairs), so that each mode sees
as many stale records as the others on average.

    .venv/bin/python bench/slurm_release.py [--n 1000] [--rate 150] [--repeat 1] [--modes plain,whole,...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("plain", "whole", "split", "late", "parts", "doubling")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=150.0, help="emulated child runs made per second")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of rounds (given order, then reversed)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    subprocess.run(["make", "-s", "-C", str(REPO), "slurm-up"], check=True, stdout=subprocess.DEVNULL)
    from blocks.records import JobHandle
    from blocks.slurm.state import index_ranges
    from tasks.sweep import FIRST_RELEASE, _release_as_runs_come
    from tests.private_worker import wait_until
    from tests.stacks import stack_env

    env = {**os.environ, "SLURM_CONF": stack_env("slurm")["SLURM_CONF"]}

    def sh(*argv: str) -> str:
        return subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout

    def release(job: str, first: int, last: int) -> None:
        sh("scontrol", "release", f"{job}_[{first}-{last}]")

    def release_array(job: str) -> None:
        # Tasks released by index that already ran answer "Job has already finished" (exit 1); any
        # other answer is an error.
        done = subprocess.run(["scontrol", "release", job], env=env, capture_output=True, text=True)
        other = [
            line
            for line in (done.stdout + done.stderr).splitlines()
            if line.strip() and not line.rstrip().endswith(("Job has already finished", "No error"))
        ]
        if done.returncode != 0 and other:
            raise RuntimeError(f"scontrol release {job}: " + "; ".join(other))

    class Scontrol:
        """What the sweep policy asks of the cluster, without the settings files (``echo`` needs none)."""

        @staticmethod
        def release_sweep_tasks(
            handle: JobHandle, tasks: dict[int, dict[str, str]], *, whole_array: bool = False
        ) -> None:
            if whole_array:
                release_array(handle.job_id)
            else:
                sh("scontrol", "release", f"{handle.job_id}_[{index_ranges(tasks)}]")

    configurations = [{"seed": seed} for seed in range(args.n)]  # one configuration per array task

    def completed(job: str) -> int:
        out = sh("squeue", "--local", "-h", "-t", "all", "-j", job, "-O", "ArrayTaskID:|,State:|")
        return sum(
            1
            for line in out.splitlines()
            if line.split("|")[0].strip().isdigit() and line.split("|")[1].strip() == "COMPLETED"
        )

    def one(mode: str) -> float:
        wait_until(
            "the previous run's tasks to leave the queue",
            lambda: not sh("squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING").strip(),
            timeout=600,
            interval=1,
        )
        start = time.perf_counter()

        def made() -> int:
            return min(args.n, int(args.rate * (time.perf_counter() - start)))

        argv = ["sbatch", "--parsable", f"--array=0-{args.n - 1}", "--time=5", "--output=/dev/null", "--wrap", "echo"]
        if mode != "plain":
            argv.insert(2, "--hold")
        job = sh(*argv).strip().split(";")[0]
        if mode == "whole":
            release_array(job)
        elif mode == "split":
            release(job, 0, args.n - 1)
            release_array(job)
        elif mode in ("late", "parts"):
            released = 0
            while made() < args.n:
                ready = made() - released
                if (mode == "late" and released == 0 and ready >= FIRST_RELEASE) or (mode == "parts" and ready > 0):
                    release(job, released, released + ready - 1)
                    released += ready
                time.sleep(0.1 if mode == "parts" else 0.01)
            release_array(job)
        elif mode == "doubling":
            runs: dict[Future[str], int] = {Future(): i for i in range(args.n)}

            def come() -> None:  # each run "made" in index order, at --rate
                for future, index in runs.items():
                    while made() <= index:
                        time.sleep(0.005)
                    future.set_result(f"run-{index}")

            threading.Thread(target=come, daemon=True).start()
            handle = JobHandle(backend="slurm", job_id=job, key=job, workdir="/dev/null", log_path="/dev/null")
            _release_as_runs_come(Scontrol(), handle, {}, runs, configurations)  # type: ignore[arg-type]
        wait_until(
            f"all {args.n} tasks of {mode} array {job} COMPLETED",
            lambda: completed(job) >= args.n,
            timeout=900,
            interval=1,
        )
        return time.perf_counter() - start

    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.repeat):
        for mode in modes + modes[::-1]:
            walls[mode].append(one(mode))
            print(f"{mode:8s} N={args.n}: {walls[mode][-1]:.1f} s", flush=True)
    for mode, values in walls.items():
        print(f"{mode}: " + " / ".join(f"{v:.1f}" for v in values) + f" s (mean {sum(values) / len(values):.1f})")


if __name__ == "__main__":
    main()
