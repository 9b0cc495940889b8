"""A sweep's steps: its job array with one MLflow child run per task, and the children's metrics."""

from __future__ import annotations

import asyncio
import json
import os
import posixpath
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from prefect import get_run_logger, task
from prefect.exceptions import TerminationSignal
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_incrementing

from blocks.base.compute import ComputeBackend
from blocks.records import JobHandle, SweepJobResult, SweepTaskResult, TrainingJob
from blocks.tracking.mlflow import MlflowTracking
from runtime import contract
from tasks.retry import is_transient, retry_options
from tasks.waiting import RUN_JOB_LABEL, label_run, stop_if_cancelled

SWEEP_INDEX_TAG = "gpuferry.sweep_index"
PARENT_TAG = "mlflow.parentRunId"


def _children(tracking: MlflowTracking, experiment_id: str, parent_run_id: str) -> list:
    runs, token = [], None
    while True:
        page = tracking.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
            max_results=1000,
            page_token=token,
        )
        runs += list(page)
        token = page.token
        if not token:
            return runs


@task(name="child-metrics", **retry_options())
def child_metrics(tracking: MlflowTracking, parent_run_id: str) -> dict[str, dict[str, float]]:
    """The latest metrics of every child run, in one search."""
    experiment_id = tracking.client.get_run(parent_run_id).info.experiment_id
    return {run.info.run_id: dict(run.data.metrics) for run in _children(tracking, experiment_id, parent_run_id)}


@task(name="mark-children", **retry_options())
def mark_children(tracking: MlflowTracking, run_ids: Sequence[str], status: str) -> None:
    """End child runs whose task did not finish its run itself (it failed, or never started)."""
    for run_id in run_ids:
        if tracking.client.get_run(run_id).info.status == "RUNNING":
            tracking.end_run(run_id, status)


# The first part of a held array to release: enough tasks for the cluster to start at once.
FIRST_RELEASE = 16
# How much lower than the flow's own the CPU priority of the threads that make the child runs is
# (their nice value is raised by this much; 0 leaves it).
CHILD_RUNS_NICE = 10


def _lower_own_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux: each thread has its own), so that the
    child runs' bookkeeping yields the CPU to the cluster's daemons and the released tasks wherever
    the flow shares a machine with them (a login node, a small cluster); it needs only to keep ahead
    of the tasks. Where that is not possible, the threads keep the priority they have."""
    if by <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + by)
    except OSError:
        pass


def _release_as_runs_come(
    compute: ComputeBackend,
    handle: JobHandle,
    runs: dict[int, str],
    make: dict[Future[str], int],
    configurations: Sequence[dict[str, Any]],
) -> None:
    """Release the held array's tasks as their child runs come, in parts that double: a part goes
    once the tasks whose run exists and that are still held number at least ``FIRST_RELEASE`` and
    at least as many as all the parts before; once every run exists, the rest goes as the whole
    array.

    Why doubling parts: the runs take seconds to make (a local SQLite store spends ~6 ms of CPU on
    each: 1000 runs, 6 s), and a cluster left with nothing released meanwhile idles. Yet every
    ``scontrol release`` by index makes slurmctld split those tasks into job records of their own, and
    many small releases slowed its scheduling (``bench/slurm_release.py``: a part every 0.1 s was
    slower than doubling parts), while the tasks released with the whole array stay in its one record
    until they start. Parts that double keep about as much work released ahead of the cluster as it
    has already been given, in about log2(N / 16) releases. (A part a second on top of those, 13
    releases instead of 7 for 1000 runs, measured 1.31× the floor against doubling parts' 1.20× in
    the same two-block P1 benchmark.)
    """

    def settings(index: int) -> dict[str, str]:
        return {contract.HPARAMS: json.dumps(configurations[index]), contract.MLFLOW_RUN_ID: runs[index]}

    ready = sorted(runs)  # adopted by a retry: their tasks may have run already
    released, left = 0, len(make)
    for future in as_completed(make):  # (concurrent.futures.wait per run would cost O(runs²))
        runs[make[future]] = future.result()  # a failed run creation fails the task
        ready.append(make[future])
        left -= 1
        if left and len(ready) >= max(FIRST_RELEASE, released):
            compute.release_sweep_tasks(handle, {i: settings(i) for i in ready})
            released, ready = released + len(ready), []
    compute.release_sweep_tasks(handle, {i: settings(i) for i in ready}, whole_array=True)


def _last_attempt() -> bool:
    """True in the last attempt the task's retry policy allows (or outside a task run)."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context is None or context.task_run.run_count > context.task.retries


def _cancel_array(compute: ComputeBackend, job: TrainingJob, handle: JobHandle | None, why: str) -> None:
    """Cancel the sweep's array (found by its key when the submit failed before answering), so
    that none of its held or queued tasks is left waiting; the error that got here is raised after."""
    logger = get_run_logger()
    try:
        if handle is None:
            job_id = compute.find_job(job.key)
            if job_id is None:
                return
            handle = JobHandle(
                backend=compute.backend_name, job_id=job_id, key=job.key, workdir=job.workdir, log_path=""
            )
        logger.warning("%s: cancelling job array %s", why, handle.job_id)
        compute.cancel(handle)
    except Exception as exc:  # noqa: BLE001 - the sweep's own error matters more; say what is left behind
        logger.error(
            "could not cancel the job array of %s (cancel it with scancel --name=%s): %r", job.key, job.key, exc
        )


# Submitting is idempotent (the job key) and so are the child runs (their index tag): a retry adopts
# the array and the runs instead of making others.
@task(name="train-sweep", **retry_options(retries=3))
def train_sweep(
    compute: ComputeBackend,
    job: TrainingJob,
    configurations: Sequence[dict[str, Any]],
    tracking: MlflowTracking,
    parent_run_id: str,
    parallelism: int | None = None,
    timeout_seconds: float | None = None,
    run_workers: int | None = None,
) -> tuple[list[str], SweepJobResult]:
    """Run ``job`` once per configuration as ONE job array, each in an MLflow run that is a child of
    ``parent_run_id``; wait for all of it (one poll per cycle). Returns the child run ids (by
    configuration) and the array's outcome.

    The array is queued held first. Meanwhile the child runs are made (``run_workers`` at a time,
    by default ``tracking.concurrent_writes``, at a CPU priority ``CHILD_RUNS_NICE`` below the
    flow's); tasks are released in doubling parts as their runs come and run while the others are
    made, and the rest as the whole array once every run exists (``_release_as_runs_come``).
    When the task fails for good (an error no retry mends, its last attempt, the flow run stopped)
    it cancels the array first: no held task is left in the queue.
    (The flow's preflight has validated the job; a job the cluster refuses fails the submit at once,
    and the few runs made meanwhile are marked FAILED by the flow.)
    """
    logger = get_run_logger()
    if not compute.supports_arrays:
        raise compute.no_arrays()
    client = tracking.client
    parent = client.get_run(parent_run_id)
    experiment_id = parent.info.experiment_id
    runs: dict[int, str] = {}
    for run in _children(tracking, experiment_id, parent_run_id):
        index = run.data.tags.get(SWEEP_INDEX_TAG, "")
        if index.isdigit() and int(index) < len(configurations):
            runs[int(index)] = run.info.run_id
    found = len(runs)

    def make_run(index: int) -> str:
        tags = {
            PARENT_TAG: parent_run_id,
            SWEEP_INDEX_TAG: str(index),
            "gpuferry.hparams": json.dumps(configurations[index], sort_keys=True),
        }
        # A local SQLite store lets one writer in at a time and rolls a refused one back: that one tries again.
        create = Retrying(
            retry=retry_if_exception(lambda exc: "database is locked" in str(exc)),
            stop=stop_after_attempt(5),
            wait=wait_incrementing(start=0.2, increment=0.2),
            reraise=True,
        )
        return create(
            lambda: client.create_run(experiment_id, run_name=f"{parent.info.run_name}-{index}", tags=tags).info.run_id
        )

    handle = None
    workers = run_workers or tracking.concurrent_writes
    with ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix="child-runs",
        initializer=_lower_own_priority,
        initargs=(CHILD_RUNS_NICE,),
    ) as pool:
        make = {pool.submit(make_run, i): i for i in range(len(configurations)) if i not in runs}
        try:
            handle = compute.submit_held_sweep(job, len(configurations), parallelism=parallelism)
            label_run({RUN_JOB_LABEL: handle.model_dump_json()})
            logger.info(
                "sweep of %d configurations: job array %s (workdir %s), released as its child runs come",
                len(configurations),
                handle.job_id,
                handle.workdir,
            )
            _release_as_runs_come(compute, handle, runs, make, configurations)
            logger.info("%d child runs of %s (%d made now)", len(runs), parent_run_id, len(runs) - found)
            status = compute.watch(
                handle,
                on_state=lambda s: logger.info("job array %s: %s", handle.job_id, s.summary()),
                timeout_seconds=timeout_seconds,
            )
        except BaseException as exc:
            for future in make:
                future.cancel()
            stopped = isinstance(exc, (TerminationSignal, KeyboardInterrupt, asyncio.CancelledError))
            if stopped or not is_transient(exc) or _last_attempt():
                # A retry would adopt the array and go on; without one it must not wait held forever.
                _cancel_array(compute, job, handle, "the flow run was stopped" if stopped else f"{exc!r}")
            raise
    if status.state == "CANCELLED":
        stop_if_cancelled(f"job array {handle.job_id} ended CANCELLED")
    outcome = compute.array_outcome(handle, len(configurations))
    results = [
        SweepTaskResult(
            index=i,
            status=state,
            checkpoint_dir=posixpath.join(compute.task_dir(job.workdir, i), "checkpoints"),
            requeues=int(usage["requeues"]),
            wall_seconds=usage["wall_seconds"],
            gpu_hours=usage["gpu_hours"],
            cpu_hours=usage["cpu_hours"],
        )
        for i, (state, usage) in sorted(outcome.items())
    ]
    failed = [r for r in results if r.status.state != "COMPLETED"]
    for r in failed[:10]:
        logger.warning("configuration %d: %s %s", r.index, r.status.state, r.status.reason)
    logger.info(
        "job array %s %s: %d of %d configurations completed",
        handle.job_id,
        status.state,
        len(results) - len(failed),
        len(results),
    )
    return [runs[i] for i in range(len(configurations))], SweepJobResult(
        handle=handle,
        tasks=results,
        gpu_hours=sum(r.gpu_hours for r in results),
        cpu_hours=sum(r.cpu_hours for r in results),
    )
