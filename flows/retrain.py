"""The retraining pipeline: provision → build → train → upload → register → deploy → release."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.exceptions import Pause
from prefect.runtime import flow_run

from blocks.base.provider import NodeRequirements
from blocks.errors import ConfigurationError
from blocks.plan import preflight
from blocks.records import PipelineResult
from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
from blocks.stack import Stack, load_stack, saved_name, stack_name
from flows.ship import ended_as, report, run_tags, ship
from runtime import contract
from tasks.build import build_image
from tasks.deploy import serving_preflight
from tasks.provision import provision_nodes, release_nodes, with_host_gpus
from tasks.track import finish_run, run_metrics, start_run
from tasks.train import train, train_suspending
from tasks.waiting import RUN_STACK_LABEL, label_run
from tasks.workload import load, plan


@flow(name="retrain", log_prints=True)
def retrain(
    workload: str,
    training: TrainingSpec = TrainingSpec(),
    serving: ServingSpec = ServingSpec(),
    promotion: PromotionPolicy = PromotionPolicy(),
    stack: Stack | str | None = None,
    force_deploy: bool = False,
    wait: Literal["block", "suspend"] = "block",
) -> PipelineResult:
    """Train the workload, store and register the model, and serve it if it beats the champion.

    Args:
        workload: the directory holding the workload's gpuferry.yaml, or git+URL@REF#subdirectory=PATH.
        training: hyperparameters (checked against the workload's schema) and resources; empty fields come
            from the workload.
        serving: how the inference service runs.
        promotion: when the new version replaces the champion (only a promoted version is deployed).
        stack: the saved ``Stack`` block choosing the backend of each step (the UI offers the saved ones), or its
            name (empty: embedded).
        force_deploy: deploy the new version even when it is not promoted.
        wait: how the run waits for the training job: ``block`` keeps this run's process polling it;
            ``suspend`` suspends the run (no process) until deployments/job_watcher.py resumes it.
    """
    blocks = load_stack(stack)
    label_run({RUN_STACK_LABEL: saved_name(stack)})
    work = load(workload)
    run = plan(work, training, serving, promotion)
    blocks = with_host_gpus(blocks)  # Docker hosts: every GPU request is checked against the host's GPUs below
    preflight(blocks, run)
    serving_preflight(blocks.serving, run.serving)  # before nodes are acquired and days of training start
    run_key = f"{flow_run.get_id() or 'local'}"
    suspended = False

    nodes = provision_nodes(
        blocks.provider, run.resources.nodes, NodeRequirements(gpus=run.resources.gpus_per_node), run_key
    )
    blocks = blocks.with_inventory(nodes)  # backends that choose GPUs themselves learn their host's
    try:
        blocks.check_gpus(run.resources, run.serving)  # nodes made on demand: their GPUs are known only now
        image = build_image(blocks.images, work)
        run_id = start_run(
            blocks.tracking,
            run.experiment,
            f"retrain-{flow_run.get_name() or run_key}",
            params=run.params(),
            tags=run_tags(blocks, image, run_key, run),
        )
        try:
            job = run.job(
                f"{run_key}-train",
                blocks.compute.job_workdir(f"{run_key}-train"),
                image,
                env={contract.MLFLOW_TRACKING_URI: blocks.tracking.tracking_uri, contract.MLFLOW_RUN_ID: run_id},
                secret_env=blocks.tracking.job_secrets(),
            )
            timeout = run.resources.time_limit_minutes * 60
            if wait == "suspend":
                result = train_suspending(blocks.compute, job, stack=stack_name(stack), timeout_seconds=timeout)
            else:
                result = train(blocks.compute, job, timeout_seconds=timeout)

            metrics = run_metrics(blocks.tracking, run_id)
            metric = run.promotion.metric
            if metric not in metrics:
                raise ConfigurationError(
                    f"promotion.metric={metric!r} was not logged by the run; it logged: {sorted(metrics)}"
                )
            checkpoint, version, endpoint = ship(
                blocks,
                run,
                run_id=run_id,
                trained=result,
                value=metrics[metric],
                image=image,
                force_deploy=force_deploy,
            )
        except Pause:  # suspended while the job runs: the run, its nodes and its job carry on
            suspended = True
            raise
        except BaseException as exc:
            finish_run(blocks.tracking, run_id, ended_as(exc))
            raise
        finish_run(blocks.tracking, run_id)
    finally:
        if not suspended:
            release_nodes(blocks.provider, nodes)

    outcome = PipelineResult(
        run_id=run_id,
        run_url=blocks.tracking.run_url(run_id),
        image=image,
        checkpoint=checkpoint,
        model_version=version,
        metrics=metrics,
        endpoint=endpoint,
        deployed=endpoint is not None,
    )
    report(outcome)
    return outcome
