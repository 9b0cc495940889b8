"""Load the workload a run trains (its gpuferry.yaml from a path or a git URL) and plan the run against it."""

from __future__ import annotations

from prefect import get_run_logger, task

from blocks.plan import RunPlan, plan_run
from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
from blocks.workload.source import Workload, load_workload
from tasks.retry import retry_options


@task(name="load-workload", **retry_options(retries=3))
def load(source: str) -> Workload:
    """The workload at ``source``; fetching a git URL again is what a retry does after a network error."""
    workload = load_workload(source)
    where = (
        f"commit {workload.commit[:12]}{' + uncommitted changes' if workload.dirty else ''}"
        if workload.commit
        else "not in git"
    )
    get_run_logger().info(
        "workload %s from %s (%s; code %s, %d files)",
        workload.name,
        workload.source,
        where,
        workload.code.sha256[:12],
        workload.code.files,
    )
    return workload


def plan(workload: Workload, training: TrainingSpec, serving: ServingSpec, promotion: PromotionPolicy) -> RunPlan:
    """The run's settings over the workload's defaults; raises before anything is acquired (no outside call)."""
    return plan_run(workload, training, serving, promotion)
