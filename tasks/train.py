"""Run the training job on the stack's compute backend and wait for it."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from blocks.compute import ComputeBackend
from blocks.specs import JobResult, TrainingJob
from tasks.retry import retry_options


def _progress_fraction(progress: dict[str, Any]) -> float:
    total = progress.get("total_steps") or 0
    return 0.0 if not total else min(100.0, 100.0 * progress.get("step", 0) / total)


# Submitting is idempotent (the job key), so a retry adopts the job instead of starting another.
@task(name="train", **retry_options(retries=3))
def train(compute: ComputeBackend, job: TrainingJob, timeout_seconds: float | None = None) -> JobResult:
    logger = get_run_logger()
    handle = compute.submit(job)
    logger.info("training job %s on %s (workdir %s)", handle.job_id, handle.backend, handle.workdir)
    artifact_id = create_progress_artifact(0.0, key="training-progress", description="Training steps done")

    def on_progress(progress: dict[str, Any]) -> None:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in progress.get("metrics", {}).items())
        update_progress_artifact(
            artifact_id, _progress_fraction(progress),
            description=f"step {progress.get('step')}/{progress.get('total_steps')} {metrics}",
        )  # fmt: skip

    def on_output(text: str) -> None:
        for line in text.rstrip("\n").splitlines():
            logger.info("[job %s] %s", handle.job_id, line)

    status = compute.watch(handle, on_progress=on_progress, on_output=on_output, timeout_seconds=timeout_seconds)
    result = compute.result(
        handle, status, gpus=job.resources.gpus_per_node * job.resources.nodes,
        cpus=job.resources.cpus_per_task * job.resources.world_size,
    )  # fmt: skip
    update_progress_artifact(artifact_id, 100.0, description=f"finished: {status.state}")
    logger.info("job %s %s in %.1f s (%d requeues)", handle.job_id, status.state, result.wall_seconds, result.requeues)
    return result
