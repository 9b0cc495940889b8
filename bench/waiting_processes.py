"""P4 "waiting costs nothing": the processes held while N training jobs wait, suspended vs blocking.

Both designs run side by side in one run, against the Prefect server of `make prefect-up`, with a
worker of their own (its own process pool, so only these runs are counted):

* blocking: each flow run's train step (``tasks.train.train``) keeps its process, polling its job;
* suspend: each flow run submits its job, labels itself and suspends (``tasks.train.train_suspending``):
  no process while the job runs; ONE watcher (``deployments/job_watcher.py``) polls all jobs in one
  batched query and resumes each run when its job ends.

The jobs are real local jobs (``LocalProcesses``: a supervisor and a script that sleeps until the
benchmark releases it), so they run as long as the measurement needs. Once all N runs wait, the
Python processes held for waiting are counted: the worker, its flow-run processes, the watcher (the
jobs themselves are not counted: on a cluster they run on its nodes). Then the jobs are released and
every run must complete.

    .venv/bin/python bench/waiting_processes.py [--jobs 50]

Prints ``RESULT P4_waiting_processes_suspend <n>``, ``RESULT P4_waiting_processes_blocking <n>``,
their memory (``P4_waiting_rss_mib_*``) and the time from release until all runs completed
(``P4_waiting_release_to_completed_s_*``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefect import flow

from tests.private_worker import wait_until

POOL = "gpuferry-bench-waiting"
DEPLOYMENT = "waiting-bench"
FLOW = "wait-for-training"
STACK_BLOCK = "gpuferry-bench-waiting"
RELEASE_ENV = "GPUFERRY_BENCH_RELEASE"
JOB_MARKERS = ("blocks.local.job_runner", "sleep_job.py")
# The job: sleeps until the release file exists (a stand-in for hours of training), or its directory is gone.
STARTED: list[Any] = []  # every flow run this benchmark started (cancelled at the end if not finished)
SLEEP_JOB = f"""import os, time
release = os.environ[{RELEASE_ENV!r}]
while not os.path.exists(release) and os.path.isdir(os.path.dirname(release)):
    time.sleep(1)
"""


@flow(name=FLOW)
def wait_for_training(stack: str, key: str, release_file: str, wait: str = "block") -> str:
    """Submit one job on ``stack`` and wait for it the way ``wait`` says (the retrain flow's train step)."""
    from blocks.records import TrainingJob
    from blocks.workload.source import code_archive
    from flows.retrain import load_stack
    from tasks.train import train, train_suspending

    compute = load_stack(stack).compute
    job = TrainingJob(
        key=key,
        workdir=compute.job_workdir(key),
        command=["python", "sleep_job.py"],
        code=code_archive(Path(release_file).parent / "code"),
        env={RELEASE_ENV: release_file},
    )
    if wait == "suspend":
        result = train_suspending(compute, job, stack=stack, timeout_seconds=3600)
    else:
        result = train(compute, job, timeout_seconds=3600)
    return result.status.state


# ---- processes -----------------------------------------------------------------------------------


def _processes() -> dict[int, tuple[int, str, int]]:
    """pid → (parent pid, command line, RSS in KiB) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry)] = (ppid, cmd, rss)
    return out


def held(worker_pid: int, watcher_pid: int | None) -> dict[str, Any]:
    """The processes held for waiting: the worker, its descendants that are not jobs, the watcher."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [worker_pid]
    while todo:
        pid = todo.pop()
        if pid in procs:
            tree.append(pid)
            todo.extend(children.get(pid, []))
    roots = tree + ([watcher_pid] if watcher_pid in procs else [])
    counted = [p for p in roots if not any(m in procs[p][1] for m in JOB_MARKERS)]
    jobs = [p for p, (_, cmd, _) in procs.items() if any(m in cmd for m in JOB_MARKERS)]
    return {
        "processes": len(counted),
        "flow_run_processes": len([p for p in counted if p not in (worker_pid, watcher_pid)]),
        "rss_mib": sum(procs[p][2] for p in counted) / 1024,
        "job_processes": len(jobs),
    }


# ---- the Prefect side ----------------------------------------------------------------------------


def run_states(ids: list[Any]) -> list[tuple[str, str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=len(ids) + 1)
    return [(r.state_type.value if r.state_type else "", r.state_name or "") for r in runs]


def cancel_unfinished(ids: list[Any]) -> None:
    """After a failure: no run of this benchmark stays suspended or running on the shared server."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            for run_id in ids:
                state = client.read_flow_run(run_id).state
                if state is not None and not state.is_final():
                    client.set_flow_run_state(run_id, Cancelled(message="benchmark ended"), force=True)
    except Exception as exc:  # noqa: BLE001 - best effort at exit
        print(f"could not cancel the unfinished runs: {exc}")


def setup(tmp: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    from blocks.local.compute import LocalProcesses
    from blocks.stack import Stack

    code = tmp / "code"
    code.mkdir()
    (code / "sleep_job.py").write_text(SLEEP_JOB)
    stack = Stack.embedded()
    stack.compute = LocalProcesses(workdir_root=str(tmp / "jobs"))
    stack.save(STACK_BLOCK, overwrite=True)
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
    wait_for_training.from_source(source=str(REPO), entrypoint="bench/waiting_processes.py:wait_for_training").deploy(
        name=DEPLOYMENT, work_pool_name=POOL, print_next_steps=False, ignore_warnings=True
    )


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def measure(mode: str, n: int, tmp: Path, env: dict[str, str], worker: subprocess.Popen[bytes]) -> dict[str, Any]:
    from prefect.deployments import run_deployment

    watcher = None
    if mode == "suspend":
        watcher = start([sys.executable, "-m", "deployments.job_watcher", "--interval", "2"], env, tmp / "watcher.log")
    release = tmp / f"release-{mode}"
    uid = uuid.uuid4().hex[:6]
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        run = run_deployment(
            f"{FLOW}/{DEPLOYMENT}",
            timeout=0,
            parameters={
                "stack": STACK_BLOCK,
                "key": f"bench-{uid}-{mode}-{i:03d}",
                "release_file": str(release),
                "wait": "block" if mode == "blocking" else "suspend",
            },
        )
        ids.append(run.id)
        STARTED.append(run.id)
    want = ("RUNNING", "Running") if mode == "blocking" else ("PAUSED", "Suspended")

    def all_waiting() -> bool:
        states = run_states(ids)
        failed = [s for s in states if s[0] in ("FAILED", "CRASHED", "CANCELLED")]
        if failed:
            raise SystemExit(f"{mode}: {len(failed)} runs failed before waiting: {failed[:3]} (see {tmp})")
        jobs_up = len(list((tmp / "jobs").glob(f"bench-{uid}-*/job.json")))
        now = held(worker.pid, watcher.pid if watcher else None)
        print(
            f"  {mode}: {sum(s == want for s in states)}/{n} {want[1]}, {jobs_up} jobs started, "
            f"{now['flow_run_processes']} flow-run processes",
            flush=True,
        )
        if jobs_up < n or sum(s == want for s in states) < n:
            return False
        # Suspended runs' processes exit right after suspending; blocking ones stay.
        return mode == "blocking" or now["flow_run_processes"] == 0

    wait_until(f"{n} {mode} runs to wait", all_waiting, timeout=1200, interval=5)
    settled_s = time.monotonic() - t0
    # Several samples over ~10 s: the largest count is the one held.
    samples = []
    for _ in range(5):
        samples.append(held(worker.pid, watcher.pid if watcher else None))
        time.sleep(2)
    worst = max(samples, key=lambda s: s["processes"])

    release.touch()
    t1 = time.monotonic()

    def all_done() -> bool:
        states = run_states(ids)
        bad = [s for s in states if s[0] in ("FAILED", "CRASHED", "CANCELLED")]
        if bad:
            raise SystemExit(f"{mode}: {len(bad)} runs failed after the release: {bad[:3]} (see {tmp})")
        return sum(s[0] == "COMPLETED" for s in states) == n

    wait_until(f"{n} {mode} runs to complete", all_done, timeout=1200, interval=2)
    stop(watcher)
    return {**worst, "settled_s": settled_s, "release_to_completed_s": time.monotonic() - t1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="training jobs waiting at once")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    subprocess.run(["make", "-s", "prefect-up"], cwd=REPO, check=True)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.stacks import stack_env

    api_url = stack_env("prefect")["PREFECT_API_URL"]
    with temporary_settings({PREFECT_API_URL: api_url}):
        return run(args, api_url)


def run(args: argparse.Namespace, api_url: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gpuferry-waiting-"))
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "GPUFERRY_HOME": str(tmp / "home"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_HOME", None)
    worker = None
    try:
        setup(tmp)
        worker = start(
            [
                str(REPO / ".venv/bin/prefect"),
                "worker",
                "start",
                "--pool",
                POOL,
                "--type",
                "process",
                "--name",
                f"bench-waiting-{uuid.uuid4().hex[:6]}",
            ],
            env,
            tmp / "worker.log",
        )
        results = {}
        for mode in ("suspend", "blocking"):
            print(f"{mode}: {args.jobs} flow runs, each waiting on its own job", flush=True)
            results[mode] = measure(mode, args.jobs, tmp, env, worker)
            r = results[mode]
            print(
                f"{mode}: {r['processes']} processes held ({r['flow_run_processes']} flow-run processes), "
                f"{r['rss_mib']:.0f} MiB; {r['job_processes']} job processes; "
                f"all waiting after {r['settled_s']:.0f} s; "
                f"release → all completed {r['release_to_completed_s']:.1f} s",
                flush=True,
            )
        for mode, r in results.items():
            print(f"RESULT P4_waiting_processes_{mode} {r['processes']}")
            print(f"RESULT P4_waiting_rss_mib_{mode} {r['rss_mib']:.0f}")
            print(f"RESULT P4_waiting_release_to_completed_s_{mode} {r['release_to_completed_s']:.1f}")
        return 0
    finally:
        cancel_unfinished(STARTED)
        stop(worker)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    sys.exit(main())
