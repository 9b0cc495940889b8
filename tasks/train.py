"""Run the training job on the stack's compute backend and wait for it."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.exceptions import TerminationSignal

from blocks.base.compute import ComputeBackend
from blocks.records import JobHandle, JobResult, JobStatus, TrainingJob
from tasks.retry import retry_options
from tasks.waiting import RUN_JOB_LABEL, label_run, register_wait, stop_if_cancelled, wait_verdict


def _progress_fraction(progress: dict[str, Any]) -> float:
    total = progress.get("total_steps") or 0
    return 0.0 if not total else min(100.0, 100.0 * progress.get("step", 0) / total)


# Submitting is idempotent (the job key), so a retry adopts the job instead of starting another.
@task(name="train", **retry_options(retries=3))
def train(compute: ComputeBackend, job: TrainingJob, timeout_seconds: float | None = None) -> JobResult:
    logger = get_run_logger()
    handle = compute.submit(job)
    logger.info("training job %s on %s (workdir %s)", handle.job_id, handle.backend, handle.workdir)
    label_run({RUN_JOB_LABEL: handle.model_dump_json()})
    artifact_id = cast(  # sync here: Prefect types it as a coroutine too
        UUID, create_progress_artifact(0.0, key="training-progress", description="Training steps done")
    )

    done = [0.0]  # the share of steps done so far, kept for the state notes

    def on_progress(progress: dict[str, Any]) -> None:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in progress.get("metrics", {}).items())
        done[0] = _progress_fraction(progress)
        update_progress_artifact(
            artifact_id,
            done[0],
            description=f"step {progress.get('step')}/{progress.get('total_steps')} {metrics}",
        )

    def on_state(status: JobStatus) -> None:
        logger.info("job %s: %s", handle.job_id, status.summary())
        if status.state != "RUNNING":  # while it runs, the steps say more
            update_progress_artifact(artifact_id, done[0], description=f"job {handle.job_id}: {status.summary()}")

    def on_output(text: str) -> None:
        for line in text.rstrip("\n").splitlines():
            logger.info("[job %s] %s", handle.job_id, line)

    try:
        status = compute.watch(
            handle, on_progress=on_progress, on_output=on_output, on_state=on_state, timeout_seconds=timeout_seconds
        )
    except (TerminationSignal, KeyboardInterrupt, asyncio.CancelledError):
        # The flow run was cancelled (Prefect's runner/worker delivers that as SIGTERM, raised here as
        # TerminationSignal) or interrupted: the job must not go on using the cluster unwatched.
        logger.warning("the flow run was stopped: cancelling job %s", handle.job_id)
        compute.cancel(handle)
        raise
    if status.state == "CANCELLED":
        stop_if_cancelled(f"training job {handle.job_id} ended CANCELLED")
    result = compute.result(
        handle,
        status,
        gpus=job.resources.gpus_per_node * job.resources.nodes,
        cpus=job.resources.cpus_per_task * job.resources.world_size,
    )
    update_progress_artifact(artifact_id, 100.0, description=f"finished: {status.state}")
    logger.info("job %s %s in %.1f s (%d requeues)", handle.job_id, status.state, result.wall_seconds, result.requeues)
    return result


# ---- waiting without a process: the flow suspends while its job runs ------------------------------
# A suspended flow run holds no process; deployments/job_watcher.py (one process for every waiting run)
# polls the jobs in one batched query per stack and resumes the run whose job ended. The resumed run
# executes the flow again from the top: every step before this one is idempotent (keys), submitting
# adopts the running job, and the suspension that already fired is passed over (its key).


@task(name="submit-training", **retry_options(retries=3))
def submit_training(compute: ComputeBackend, job: TrainingJob) -> JobHandle:
    handle = compute.submit(job)
    get_run_logger().info("training job %s on %s (workdir %s)", handle.job_id, handle.backend, handle.workdir)
    label_run({RUN_JOB_LABEL: handle.model_dump_json()})
    return handle


@task(name="poll-training", **retry_options(retries=3))
def poll_training(compute: ComputeBackend, handle: JobHandle) -> JobStatus:
    return compute.poll([handle])[handle.job_id]


@task(name="collect-training")
def collect_training(compute: ComputeBackend, job: TrainingJob, handle: JobHandle, status: JobStatus) -> JobResult:
    result = compute.result(
        handle,
        status,
        gpus=job.resources.gpus_per_node * job.resources.nodes,
        cpus=job.resources.cpus_per_task * job.resources.world_size,
    )
    get_run_logger().info(
        "job %s %s in %.1f s (%d requeues)", handle.job_id, status.state, result.wall_seconds, result.requeues
    )
    return result


def train_suspending(
    compute: ComputeBackend, job: TrainingJob, *, stack: str = "", timeout_seconds: float | None = None
) -> JobResult:
    """The train step for long jobs: submit, then suspend the flow run until the job watcher resumes it.

    Call it from a flow run of a deployment (only those can be suspended). ``stack`` names the saved
    Stack block whose compute backend the watcher polls ('' = embedded). The suspension has no expiry of
    its own: the run waits as long as its job lives, however long it is queued or requeued (Slurm's
    ``--time`` bounds each attempt). The watcher ends every wait (``blocks/base/watchdog.py``): when the job
    ended, and when it gives up on it: a job the backend lost, or an attempt that ran past
    ``timeout_seconds`` on a backend that does not enforce the limit itself; the run then fails saying why.
    """
    from prefect.flow_runs import suspend_flow_run

    handle = submit_training(compute, job)
    for attempt in itertools.count():
        failure = wait_verdict(handle)  # the job watcher gave up on the job and resumed this run to fail
        if failure is not None:
            raise failure
        status = poll_training(compute, handle)
        if status.terminal:
            return collect_training(compute, job, handle, status)
        register_wait(handle, stack, time_limit_seconds=timeout_seconds)
        # Returns at once when this key's suspension already fired and was resumed (a re-executed run).
        suspend_flow_run(key=f"{handle.job_id}-{attempt}", timeout=None)
    raise AssertionError("unreachable")
