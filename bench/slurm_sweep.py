"""P1/P2: a 1000-configuration sweep on the local Slurm — ours vs submitit's map_array vs a plain array.

Every configuration runs a trivial command, so this measures orchestration, not training.

* ours: the sweep flow's own task in a flow — ``train_sweep``: ONE job array over SSH, queued
  held while one MLflow child run per configuration is made (in an SQLite store in WAL mode, by a
  thread whose nice value is 10 above the flow's: on these 2 cores it yields to Slurm); its
  tasks are released in doubling parts as their runs come, the rest as the whole array once every
  run exists (tasks/sweep.py: ``_release_as_runs_come``); each task exports its configuration and run id from
  tasks/<i>.env and runs ``sh sweep_task.sh`` (bench/sweep_task/, shipped once as the job's code); one
  batched poll per cycle, as often as the
  floor's (1 s); then the final state and usage of every task;
* submitit: ``AutoExecutor(...).map_array(f, configurations)`` and every ``job.result()``;
* plain (the floor): ``sbatch --array=0-N-1 --wrap 'echo ...'`` polled a second by the same query
  as ours (one ``squeue -j <id>``) until all N tasks are COMPLETED.

Slurm's own pace varies here: slurmctld keeps finished records for MinJobAge (300 s) and every
scheduling pass walks them, so each run is slower than the one before; and without an Epilog a
finished task's CPUs wait for slurmctld's one-second tick or not, by a race in slurmd, so the
throughput of the same array flips between ~16 and ~60 tasks a second from run to run. So ours and
the floor run in blocks of four, plain, ours, ours, plain (each block starts on a controller that
holds no job record; within it, each run starts once nothing is queued or running): both sides see
the same stale records on average. P1_vs_floor is the sum of ours' walls over the sum of the floor's.
submitit runs once, first, on a controller with no job record.

slurmctld RPCs come from ``sdiag`` (reset before each run, REQUEST_STATS_INFO itself excluded). P2
also measures one poll of ours with 1 and with 1000 (held) jobs watched (5 times each; the least
count is the poll's own, since other clients of a shared cluster only add RPCs).

    .venv/bin/python bench/slurm_sweep.py [--n 1000] [--blocks 3] [--skip-submitit]

Needs submitit importable (a dependency of the benchmarks). Prints ``RESULT P1 <ours/submitit wall>``,
``RESULT P1_vs_floor <ours/plain wall>``, ``RESULT P2 <ours/submitit RPCs>`` and
``RESULT P2_per_poll <RPCs per poll at 1000 jobs / at 1>``. Goals: P1 ≤ 0.6, P1_vs_floor ≤ 1.15,
P2 ≤ 0.3, P2_per_poll = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "bench" / "sweep_task"  # the code of one configuration's job
sys.path.insert(0, str(REPO))


def stack_env() -> dict[str, str]:
    subprocess.run(["make", "-C", str(REPO), "slurm-up"], check=True, stdout=subprocess.DEVNULL)
    from tests.stacks import stack_env as written

    return written("slurm")


class Sdiag:
    """slurmctld RPC counts by message type, from ``sdiag`` (reset with ``sdiag -r``)."""

    def __init__(self, slurm_conf: str) -> None:
        self.env = {**os.environ, "SLURM_CONF": slurm_conf}

    def reset(self) -> None:
        subprocess.run(["sdiag", "-r"], env=self.env, check=True, capture_output=True)

    def rpcs(self) -> dict[str, int]:
        out = subprocess.run(["sdiag"], env=self.env, check=True, capture_output=True, text=True).stdout
        section = out.split("Remote Procedure Call statistics by message type", 1)[1].split(
            "Remote Procedure Call statistics by user", 1
        )[0]
        counts = {m[1]: int(m[2]) for m in re.finditer(r"^\s*(\w+)\s*\(\s*\d+\)\s*count:(\d+)", section, re.M)}
        counts.pop("REQUEST_STATS_INFO", None)
        return counts


def measured(sdiag: Sdiag, fn: Callable[[], Any]) -> tuple[float, int, dict[str, int], Any]:
    sdiag.reset()
    start = time.perf_counter()
    value = fn()
    wall = time.perf_counter() - start
    counts = sdiag.rpcs()
    return wall, sum(counts.values()), counts, value


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU-seconds of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / ticks, sum(fields[:8]) / ticks


def own_cpu() -> float:
    """CPU-seconds of this process (the orchestrating side: flow, threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Clock:
    """Starts a side's measurement once its setup is done: RPC counters reset, wall clock and CPU
    counters started. The stop also says how busy the machine was (Slurm's daemons and tasks, sshd and
    this process share its cores) and how much CPU this process spent orchestrating."""

    def __init__(self, sdiag: Sdiag) -> None:
        self.sdiag, self.t0 = sdiag, 0.0
        self.cpu0, self.own0 = (0.0, 0.0), 0.0
        self.cpu: dict[str, float] = {}  # the last stop's CPU figures

    def start(self) -> None:
        self.sdiag.reset()
        self.cpu0, self.own0 = machine_cpu(), own_cpu()
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, int, dict[str, int]]:
        wall = time.perf_counter() - self.t0
        busy, total = (b - a for a, b in zip(self.cpu0, machine_cpu(), strict=True))
        self.cpu = {
            "machine_busy_cpu_s": round(busy, 1),
            "machine_busy_pct": round(100 * busy / max(total, 1e-9)),
            "bench_process_cpu_s": round(own_cpu() - self.own0, 1),
        }
        counts = self.sdiag.rpcs()
        return wall, sum(counts.values()), counts


def wait_quiet(cluster: Any) -> float:
    """Wait until the controller holds no job record at all, and return how long that took.

    Every side starts on the same controller: none of an earlier side's jobs still runs, and none of
    its finished records is left in slurmctld's memory (it keeps them MinJobAge, 300 s here, and
    every scheduling pass walks them), so no side pays for the one that ran before it.
    """
    start = time.monotonic()
    deadline = start + 900
    while time.monotonic() < deadline:
        if not cluster._squeue():
            return time.monotonic() - start
        time.sleep(5)
    raise RuntimeError("the controller still holds job records after 900 s")


def wait_idle(cluster: Any) -> None:
    """Wait until no job is pending, running or completing (finished records may stay)."""
    from tests.private_worker import wait_until

    busy = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "SUSPENDED")
    wait_until(
        "the queue to empty",
        lambda: not any(r["job_state"] in busy for r in cluster._squeue()),
        timeout=600,
        interval=1,
    )


# ---- the three sides -------------------------------------------------------------------------------


def run_ours(clock: Clock, cluster: Any, n: int, workdir: Path) -> dict[str, Any]:
    from prefect import flow

    from blocks.records import TrainingJob
    from blocks.specs import Resources
    from blocks.tracking.mlflow import MlflowTracking
    from blocks.workload.source import code_archive
    from runtime import contract
    from tasks.sweep import train_sweep

    tracking = MlflowTracking(
        tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", artifact_location=(workdir / "artifacts").as_uri()
    )
    experiment = tracking.experiment_id("bench-sweep")  # creating the store is not part of the sweep
    # The store itself puts its SQLite file in write-ahead-log mode (blocks/tracking/mlflow.py).
    with sqlite3.connect(workdir / "mlflow.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    configurations = [{"seed": seed} for seed in range(n)]
    key = f"bench-{uuid.uuid4().hex[:8]}-sweep"
    # The trivial work of one configuration: `sh sweep_task.sh` echoes its HPARAMS.
    job = TrainingJob(
        key=key,
        workdir=cluster.job_workdir(key),
        command=["sh", "sweep_task.sh"],
        code=code_archive(TASK_DIR),
        resources=Resources(time_limit_minutes=5),
        env={contract.MLFLOW_TRACKING_URI: tracking.tracking_uri},
    )
    marks: dict[str, float] = {}

    @flow(name="bench-sweep")
    def bench_sweep() -> Any:
        parent = tracking.client.create_run(experiment, run_name=key).info.run_id
        children, result = train_sweep(cluster, job, configurations, tracking, parent)
        assert len(set(children)) == n
        return result

    watch = cluster.watch
    polls = [0]

    def counting_watch(*args: Any, **kwargs: Any) -> Any:
        original_poll = cluster.poll

        def poll(handles: Any) -> Any:
            polls[0] += 1
            return original_poll(handles)

        object.__setattr__(cluster, "poll", poll)
        try:
            status = watch(*args, **kwargs)
            marks["completion_seen_s"] = time.perf_counter() - marks["t0"]
            return status
        finally:
            object.__delattr__(cluster, "poll")

    release = cluster.release_sweep_tasks
    releases = [0]

    def timed_release(*args: Any, **kwargs: Any) -> Any:
        releases[0] += 1
        if releases[0] == 1:
            marks["first_release_s"] = time.perf_counter() - marks["t0"]
        release(*args, **kwargs)
        marks["all_released_s"] = time.perf_counter() - marks["t0"]

    object.__setattr__(cluster, "watch", counting_watch)
    object.__setattr__(cluster, "release_sweep_tasks", timed_release)
    clock.start()
    marks["t0"] = clock.t0
    try:
        result = bench_sweep()
    finally:
        object.__delattr__(cluster, "watch")
        object.__delattr__(cluster, "release_sweep_tasks")
    assert len(result.completed) == n, f"{len(result.completed)} of {n} tasks completed"
    line = cluster.read_log(
        result.handle.model_copy(update={"log_path": result.handle.log_path.replace("%a", str(n - 1))})
    )[0]
    assert json.loads(line)["seed"] == n - 1, line  # the last task got ITS configuration
    return {"polls": polls[0], "releases": releases[0], **{k: round(v, 2) for k, v in marks.items() if k != "t0"}}


def run_submitit(clock: Clock, env: dict[str, str], n: int, workdir: Path) -> dict[str, Any]:
    import submitit

    clock.start()
    # One folder for the whole array: with "%j" in it submitit makes each task's folder only after sbatch
    # returns, and a task that starts first cannot open its log there (FAILED, exit 0:53).
    executor = submitit.AutoExecutor(folder=str(workdir / "submitit"), cluster="slurm")
    executor.update_parameters(
        slurm_partition=env["SLURM_PARTITION"], timeout_min=5, cpus_per_task=1, slurm_array_parallelism=n
    )
    configurations = [{"seed": i} for i in range(n)]
    jobs = executor.map_array(_trivial, configurations)
    results = [job.result() for job in jobs]
    assert results == configurations
    return {"sacct_calls": submitit.SlurmJob.watcher.num_calls}


def _trivial(configuration: dict[str, int]) -> dict[str, int]:
    return configuration


def run_plain(clock: Clock, cluster: Any, n: int, workdir: Path) -> dict[str, Any]:
    name = f"bench-plain-{uuid.uuid4().hex[:8]}"
    clock.start()
    _, out, _ = cluster.run(
        [
            "sbatch",
            "--parsable",
            f"--array=0-{n - 1}",
            f"--job-name={name}",
            "--time=5",
            f"--output={workdir}/plain-%a.log",
            "--wrap",
            "echo $SLURM_ARRAY_TASK_ID",
        ]
    )
    job_id = out.strip().split(";")[0]
    polls = 0
    while True:
        polls += 1
        done = {
            r["array_task_id"]
            for r in cluster._squeue([job_id])
            if str(r.get("array_job_id")) == job_id
            and r.get("job_state") == "COMPLETED"
            and r.get("array_task_id") is not None
        }
        if len(done) >= n:
            return {"polls": polls}
        time.sleep(1.0)


# ---- P2: one poll with 1 and with 1000 jobs watched --------------------------------------------------


def per_poll(cluster: Any, sdiag: Sdiag, env: dict[str, str], count: int) -> list[int]:
    from blocks.records import JobHandle

    name = f"bench-poll-{uuid.uuid4().hex[:8]}"
    local = {**os.environ, "SLURM_CONF": env["SLURM_CONF"]}
    ids = []
    for _ in range(count):  # held: they stay in the controller's memory, none runs
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--hold",
                f"--job-name={name}",
                "--time=1",
                "--output=/dev/null",
                "--wrap",
                "true",
            ],
            env=local,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        ids.append(out.strip().split(";")[0])
    try:
        handles = [JobHandle(backend="slurm", job_id=i, key=name, workdir="/tmp", log_path="/dev/null") for i in ids]
        costs = []
        for _ in range(5):
            _, rpcs, _, statuses = measured(sdiag, lambda: cluster.poll(handles))
            assert len(statuses) == count and all(s.state == "PENDING" for s in statuses.values())
            costs.append(rpcs)
        return costs
    finally:
        subprocess.run(["scancel", f"--name={name}"], env=local, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="configurations (array tasks) per sweep")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of plain, ours, ours, plain")
    parser.add_argument("--skip-submitit", action="store_true", help="measure ours and the floor only")
    args = parser.parse_args()

    env = stack_env()
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # submitit runs sbatch/sacct on this machine
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # its background writes lock the SQLite store
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # so do the harness server's
    from prefect.testing.utilities import prefect_test_harness
    from pydantic import SecretStr

    from blocks.slurm.cluster import SlurmCluster
    from blocks.ssh.credentials import SshCredentials

    root = Path(tempfile.mkdtemp(prefix="bench-sweep-", dir=env["SLURM_SHARED_DIR"]))
    os.environ["GPUFERRY_HOME"] = str(root / "home")
    cluster = SlurmCluster(
        host=env["SLURM_SSH_HOST"],
        port=int(env["SLURM_SSH_PORT"]),
        slurm_conf=env["SLURM_CONF"],
        credentials=SshCredentials(
            user=env["SLURM_SSH_USER"],
            known_hosts=Path(env["SLURM_KNOWN_HOSTS"]).read_text(),
            private_key=SecretStr(Path(env["SLURM_SSH_KEY"]).read_text()),
        ),
        workdir_root=str(root / "jobs"),
        partition=env["SLURM_PARTITION"],
        poll_interval_start=0.5,
        poll_interval_max=1.0,  # the floor polls once a second too
    )
    sdiag = Sdiag(env["SLURM_CONF"])
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "ours": [], "submitit": []}
    with prefect_test_harness(server_startup_timeout=180):
        clock = Clock(sdiag)
        sides: dict[str, Callable[[], Any]] = {
            "plain": lambda: run_plain(clock, cluster, args.n, root),
            "ours": lambda: run_ours(clock, cluster, args.n, root),
            "submitit": lambda: run_submitit(clock, env, args.n, root),
        }
        # (side, whether it starts on a controller with no job record)
        order = [] if args.skip_submitit else [("submitit", True)]
        order += [
            (side, k == 0) for _ in range(args.blocks) for k, side in enumerate(("plain", "ours", "ours", "plain"))
        ]
        for side, settle in order:
            settled = wait_quiet(cluster) if settle else (wait_idle(cluster) or 0.0)
            extra = {**(sides[side]() or {}), "settle_wait_s": round(settled)}
            wall, rpcs, counts = clock.stop()
            top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
            results[side].append({"wall": wall, "rpcs": rpcs, **extra})
            print(
                f"{side:9s} N={args.n}: {wall:7.1f} s, {rpcs} slurmctld RPCs ({top}); {extra}; {clock.cpu}", flush=True
            )
        one = per_poll(cluster, sdiag, env, 1)
        many = per_poll(cluster, sdiag, env, 1000)
    print(f"ours, one poll: {one} slurmctld RPCs with 1 job watched, {many} with 1000")
    cluster.close()

    def total(side: str, key: str) -> float:
        return sum(r[key] for r in results[side])

    ours_wall, ours_rpcs = total("ours", "wall") / len(results["ours"]), total("ours", "rpcs") / len(results["ours"])
    for b in range(args.blocks):
        block = {side: sum(r["wall"] for r in results[side][2 * b : 2 * b + 2]) for side in ("plain", "ours")}
        print(
            f"block {b + 1}: ours {block['ours']:.1f} s / plain {block['plain']:.1f} s = "
            f"{block['ours'] / block['plain']:.3f}"
        )
    if results["submitit"]:
        print(f"RESULT P1 {ours_wall / results['submitit'][0]['wall']:.3f}")
    print(f"RESULT P1_vs_floor {total('ours', 'wall') / total('plain', 'wall'):.3f}")
    if results["submitit"]:
        print(f"RESULT P2 {ours_rpcs / results['submitit'][0]['rpcs']:.3f}")
    # sdiag counts every client's RPCs: other users of the cluster only ever add to a poll's count,
    # so the least of the repeats is the poll's own cost.
    print(f"RESULT P2_per_poll {min(many) / min(one):.3f}")


if __name__ == "__main__":
    main()
