"""The sweep: a hyperparameter grid trained as ONE job array, the best configuration carried on
through the pipeline (upload → register → deploy) like a retrain.

Each configuration is one array task and one MLflow run, a child of the sweep's run; the task reads
its hyperparameters and its run id by ``SLURM_ARRAY_TASK_ID`` from a file written with the job. The
array is watched with one batched poll per cycle, whatever its size.

Sweeps need a backend with job arrays (Slurm). On the embedded ``LocalProcesses`` backend the flow
stops with a ``ConfigurationError`` before anything is acquired: run configurations one at a time
with ``retrain`` there.
"""

from __future__ import annotations

import json

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from blocks.base.provider import NodeRequirements
from blocks.errors import ConfigurationError, JobFailed
from blocks.plan import preflight
from blocks.records import PipelineResult, SweepResult
from blocks.specs import PromotionPolicy, ServingSpec, SweepGrid, TrainingSpec
from blocks.stack import Stack, load_stack, saved_name
from flows.ship import ended_as, report, run_tags, ship
from runtime import contract
from tasks.build import build_image
from tasks.deploy import serving_preflight
from tasks.provision import provision_nodes, release_nodes, with_host_gpus
from tasks.sweep import child_metrics, mark_children, train_sweep
from tasks.track import finish_run, log_run, start_run
from tasks.waiting import RUN_STACK_LABEL, label_run
from tasks.workload import load, plan


@flow(name="sweep", log_prints=True)
def sweep(
    workload: str,
    grid: SweepGrid,
    training: TrainingSpec = TrainingSpec(),
    serving: ServingSpec = ServingSpec(),
    promotion: PromotionPolicy = PromotionPolicy(),
    stack: Stack | str | None = None,
    parallelism: int | None = None,
    force_deploy: bool = False,
) -> SweepResult:
    """Train every configuration of ``grid`` as one job array and ship the best one.

    Args:
        workload: the directory holding the workload's gpuferry.yaml, or git+URL@REF#subdirectory=PATH.
        grid: the configurations (each overrides ``training.hyperparameters``; any declared hyperparameter).
        training: the base hyperparameters and the resources of EACH configuration.
        serving: how the inference service runs.
        promotion: the metric that picks the best configuration, and when it replaces the champion.
        stack: a saved ``Stack`` block, or its name (its compute backend runs job arrays: Slurm, local processes).
        parallelism: the most configurations running at once (None: as many as the cluster fits).
        force_deploy: deploy the best version even when it is not promoted.
    """
    blocks = load_stack(stack)
    label_run({RUN_STACK_LABEL: saved_name(stack)})
    work = load(workload)
    run = plan(work, training, serving, promotion)
    configurations = work.definition.schema.expand_grid(run.hyperparameters, grid.values, grid.configurations)
    if not blocks.compute.supports_arrays:
        raise blocks.compute.no_arrays()
    if parallelism is not None and parallelism < 1:
        raise ConfigurationError(f"parallelism={parallelism}: give a positive number, or None for no limit")
    blocks = with_host_gpus(blocks)  # Docker hosts: every GPU request is checked against the host's GPUs below
    preflight(blocks, run)
    serving_preflight(blocks.serving, run.serving)  # before nodes are acquired and the array is submitted
    run_key = f"{flow_run.get_id() or 'local'}"
    logger = get_run_logger()

    nodes = provision_nodes(
        blocks.provider, run.resources.nodes, NodeRequirements(gpus=run.resources.gpus_per_node), run_key
    )
    blocks = blocks.with_inventory(nodes)  # backends that choose GPUs themselves learn their host's
    try:
        blocks.check_gpus(run.resources, run.serving)  # nodes made on demand: their GPUs are known only now
        image = build_image(blocks.images, work)
        params = {k: v for k, v in run.params().items() if k not in grid.values}
        params.update({"sweep.configurations": len(configurations), "sweep.grid": json.dumps(grid.values)})
        parent = start_run(
            blocks.tracking,
            run.experiment,
            f"sweep-{flow_run.get_name() or run_key}",
            params=params,
            tags={**run_tags(blocks, image, run_key, run), "gpuferry.sweep": "true"},
        )
        children: list[str] = []
        try:
            key = f"{run_key}-sweep"
            job = run.job(
                key,
                blocks.compute.job_workdir(key),
                image,
                env={contract.MLFLOW_TRACKING_URI: blocks.tracking.tracking_uri},
                secret_env=blocks.tracking.job_secrets(),
            )
            job = job.model_copy(update={"env": {k: v for k, v in job.env.items() if k != contract.HPARAMS}})
            children, array = train_sweep(
                blocks.compute, job, configurations, blocks.tracking, parent, parallelism=parallelism
            )

            failed = [children[t.index] for t in array.tasks if t.status.state != "COMPLETED"]
            if failed:
                mark_children(blocks.tracking, failed, "FAILED")
            metrics = child_metrics(blocks.tracking, parent)
            metric = run.promotion.metric
            if metric is None:
                raise ConfigurationError(
                    "a sweep promotes its best configuration by promotion.metric: set it in the workload's "
                    "gpuferry.yaml (promotion: {metric: ..., direction: ...}) or in the run's promotion"
                )
            scored = [
                (value, t)
                for t in array.completed
                if (value := metrics.get(children[t.index], {}).get(metric)) is not None
            ]
            if not scored:
                if not array.completed:
                    first = array.tasks[0].status
                    raise JobFailed(
                        f"no configuration of the sweep completed; configuration 0: {first.state} {first.reason}",
                        state=first.state,
                        exit_code=first.exit_code,
                    )
                logged = sorted({m for c in array.completed for m in metrics.get(children[c.index], {})})
                raise ConfigurationError(
                    f"promotion.metric={metric!r} was not logged by any configuration; they logged: {logged}"
                )
            pick = max if run.promotion.direction == "maximize" else min
            value, best = pick(scored, key=lambda pair: pair[0])
            best_run = children[best.index]
            logger.info("best configuration %d (%s=%.4f): %s", best.index, metric, value, configurations[best.index])
            log_run(
                blocks.tracking,
                parent,
                metrics={
                    "gpu_hours": array.gpu_hours,
                    "cpu_hours": array.cpu_hours,
                    f"best_{metric}": value,
                    "completed_configurations": len(array.completed),
                    "failed_configurations": len(failed),
                    "requeues": sum(t.requeues for t in array.tasks),
                },
                tags={"best_child_run_id": best_run, "best_index": str(best.index)},
            )

            best_run_plan = run.model_copy(update={"hyperparameters": configurations[best.index]})
            checkpoint, version, endpoint = ship(
                blocks,
                best_run_plan,
                run_id=best_run,
                trained=best,
                value=value,
                image=image,
                force_deploy=force_deploy,
                runs=[parent],
            )
        except BaseException as exc:
            status = ended_as(exc)
            mark_children(blocks.tracking, children or list(child_metrics(blocks.tracking, parent)), status)
            finish_run(blocks.tracking, parent, status)
            raise
        finish_run(blocks.tracking, parent)
    finally:
        release_nodes(blocks.provider, nodes)

    pipeline = PipelineResult(
        run_id=best_run,
        run_url=blocks.tracking.run_url(best_run),
        image=image,
        checkpoint=checkpoint,
        model_version=version,
        metrics=metrics.get(best_run, {}),
        endpoint=endpoint,
        deployed=endpoint is not None,
    )
    report(pipeline)
    create_table_artifact(
        key="sweep-configurations",
        table=[
            {
                "index": t.index,
                "state": t.status.state,
                metric: metrics.get(children[t.index], {}).get(metric),
                **configurations[t.index],
            }
            for t in array.tasks[:1000]
        ],
        description="Every configuration of the sweep and how it did",
    )
    return SweepResult(
        parent_run_id=parent,
        child_run_ids=children,
        best_index=best.index,
        best_hyperparameters=configurations[best.index],
        completed=len(array.completed),
        failed=len(failed),
        gpu_hours=array.gpu_hours,
        cpu_hours=array.cpu_hours,
        pipeline=pipeline,
    )
