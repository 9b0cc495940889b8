"""``gpuferry run``: a run through its deployment, followed (``gpuferry deploy`` registers them: cli_deploy.py).

``gpuferry run retrain|sweep|deploy`` creates the run through the deployment on the server, prints the
Prefect UI's link, follows its state and logs to the end, and prints the summary (MLflow run, model version,
endpoint); ``--local`` runs the flow in this process instead. The stack is given by name and looked up first:
a name no stack has is an error listing the saved ones.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any, cast

import typer

from blocks.errors import ConfigurationError
from deployments.cli_common import DEFAULT_POOL, PoolOption, StackOption, explained, fail
from deployments.cli_deploy import register, workload_source

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
run_app = typer.Typer(
    help="Start a run through its deployment (or --local) and follow it to its end.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# ---- gpuferry run -------------------------------------------------------------------------------------


def parse_assignments(items: list[str] | None, option: str) -> dict[str, Any]:
    """``NAME=VALUE`` items (VALUE as JSON when it parses, else a string) → {NAME: VALUE}."""
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"{option} {item!r}: write NAME=VALUE")
        try:
            out[name.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[name.strip()] = raw
    return out


def nested(assignments: dict[str, Any]) -> dict[str, Any]:
    """``{"training.resources.gpus_per_node": 1}`` → ``{"training": {"resources": {"gpus_per_node": 1}}}``."""
    out: dict[str, Any] = {}
    for dotted, value in assignments.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def check_stack_name(stack: str | None) -> None:
    """A stack given by name must be saved (the error lists the saved ones)."""
    if stack:
        from blocks.stack import Stack

        Stack.named(stack)


def ui_link(flow_run_id: Any) -> str:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base else f"flow run {flow_run_id} (no PREFECT_UI_URL)"


def follow(flow_run_id: Any, poll: float = 1.0) -> Any:
    """Print the run's state changes and logs until it ends; the final flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    seen = 0
    last_state = None
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            state = run.state.name if run.state else "?"
            if state != last_state:
                typer.echo(f"-- {datetime.now(UTC):%H:%M:%S} {run.name}: {state}")
                last_state = state
            logs = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                offset=seen,
                sort=LogSort.TIMESTAMP_ASC,
                limit=200,
            )
            for log in logs:
                typer.echo(f"{log.timestamp:%H:%M:%S} {level_name(log.level)} {log.message}")
            seen += len(logs)
            if run.state and run.state.type.value in FINAL and len(logs) < 200:
                return run
            time.sleep(poll)


def level_name(number: int) -> str:
    import logging

    return logging.getLevelName(number)


def summary(flow_run_id: Any) -> list[str]:
    """The run's summary artifact (retrain, sweep) as ``key: value`` lines."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    lines = []
    for artifact in artifacts:
        if artifact.key == "retrain-summary" and isinstance(artifact.data, str):
            for row in artifact.data.splitlines():
                cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
                if len(cells) == 2 and cells[0] and not set(cells[0]) <= {"-"}:
                    lines.append(f"{cells[0]}: {cells[1]}")
    return lines


def deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            return False
    return True


def start(
    flow: str,
    deployment: str | None,
    default_name: str,
    parameters: dict[str, Any],
    *,
    local: bool,
    follow_run: bool,
    pool: str = DEFAULT_POOL,
) -> None:
    """Run ``flow`` with ``parameters``: through the deployment (``flow/name``), or in this process.

    Without ``deployment``, the workload's own (``flow/<workload name>``) is used, and registered first (with
    its form, on ``pool``) when the server does not have it yet."""
    if local:
        run_local(flow, parameters)
        return
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment

    name = deployment or f"{flow}/{default_name}"
    if "/" not in name:
        name = f"{flow}/{name}"
    if not deployment_exists(name):
        if deployment is not None or "workload" not in parameters:
            raise ConfigurationError(
                f"no deployment {name!r} on the server: register it (`gpuferry deploy`), or "
                "name another with --deployment"
            )
        from deployments.forms import apply_forms

        names = register([parameters["workload"]], pool)
        apply_forms(names)
        typer.echo(f"registered {', '.join(names)} on work pool {pool} (`gpuferry deploy --workload` refreshes them)")
    run = cast(
        FlowRun, run_deployment(name, parameters=parameters, timeout=0)
    )  # sync here: Prefect types it as a coroutine too
    typer.echo(f"{run.name}: {ui_link(run.id)}")
    if not follow_run:
        return
    final = follow(run.id)
    for line in summary(run.id):
        typer.echo(line)
    typer.echo(f"{final.name}: {final.state.name if final.state else '?'} — {ui_link(final.id)}")
    if not (final.state and final.state.is_completed()):
        raise typer.Exit(1)


def run_local(flow: str, parameters: dict[str, Any]) -> None:
    """The flow in this process (its run still goes to PREFECT_API_URL's server when one is set)."""
    from flows.deploy_model import deploy_model
    from flows.retrain import retrain
    from flows.sweep import sweep

    fn: Any = {"retrain": retrain, "sweep": sweep, "deploy-model": deploy_model}[flow]
    state = fn(**parameters, return_state=True)
    typer.echo(f"{flow}: {ui_link(state.state_details.flow_run_id)}")
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise fail(f"{flow} failed: {result}", 1)
    from blocks.records import Endpoint, PipelineResult, SweepResult

    if isinstance(result, SweepResult | PipelineResult):
        pipeline = result.pipeline if isinstance(result, SweepResult) else result
        version = pipeline.model_version
        typer.echo(f"MLflow run: {pipeline.run_url}")
        typer.echo(
            f"model version: {version.name} v{version.version} ({version.metric}={version.value:.4g}, "
            f"{'promoted' if version.promoted else 'not promoted'})"
        )
        result = pipeline.endpoint
    typer.echo(f"endpoint: {result.url if isinstance(result, Endpoint) else 'not deployed'}")


WorkloadOption = Annotated[
    str,
    typer.Option(
        "--workload", "-w", help="The workload (a directory with gpuferry.yaml, or git+URL@REF#subdirectory=PATH)."
    ),
]
DeploymentOption = Annotated[
    str | None,
    typer.Option(
        "--deployment",
        "-d",
        help="flow/name of the deployment (default: the workload's own, from `gpuferry deploy --workload`).",
    ),
]
LocalOption = Annotated[bool, typer.Option("--local", help="Run in this process, not through the deployment.")]
FollowOption = Annotated[bool, typer.Option("--follow/--no-follow", help="Follow the run to its end.")]
HpOption = Annotated[list[str] | None, typer.Option("--hp", help="A hyperparameter, NAME=VALUE (JSON); repeatable.")]
ParamOption = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        "-p",
        help="Any flow parameter, dotted.path=VALUE (JSON), e.g. training.resources.gpus_per_node=1; repeatable.",
    ),
]


def _training_parameters(
    workload: str, stack: str | None, hp: list[str] | None, param: list[str] | None, force_deploy: bool
) -> tuple[str, dict[str, Any]]:
    from blocks.workload.source import load_workload

    check_stack_name(stack)
    source = workload_source(workload)
    name = load_workload(source).name
    parameters: dict[str, Any] = {"workload": source, "stack": stack or None}
    if hp:
        parameters["training"] = {"hyperparameters": parse_assignments(hp, "--hp")}
    if force_deploy:
        parameters["force_deploy"] = True
    return name, merge(parameters, nested(parse_assignments(param, "--param")))


@run_app.command("retrain")
@explained
def run_retrain(
    workload: WorkloadOption = ".",
    stack: StackOption = None,
    deployment: DeploymentOption = None,
    hp: HpOption = None,
    param: ParamOption = None,
    local: LocalOption = False,
    follow_run: FollowOption = True,
    pool: PoolOption = DEFAULT_POOL,
    force_deploy: Annotated[bool, typer.Option(help="Deploy even when not promoted.")] = False,
) -> None:
    """Train the workload on the stack, register the model, and serve it when it beats the champion.

    Example: `gpuferry run retrain --workload . --stack hpc --hp lr=0.01` (add --local to run it here).
    """
    name, parameters = _training_parameters(workload, stack, hp, param, force_deploy)
    start("retrain", deployment, name, parameters, local=local, follow_run=follow_run, pool=pool)


@run_app.command("sweep")
@explained
def run_sweep(
    workload: WorkloadOption = ".",
    stack: StackOption = None,
    deployment: DeploymentOption = None,
    grid: Annotated[
        list[str] | None,
        typer.Option("--grid", "-g", help="NAME=V1,V2,... (JSON values); repeatable: the grid is their product."),
    ] = None,
    hp: HpOption = None,
    param: ParamOption = None,
    local: LocalOption = False,
    follow_run: FollowOption = True,
    pool: PoolOption = DEFAULT_POOL,
    parallelism: Annotated[int | None, typer.Option(help="Configurations running at once.")] = None,
    force_deploy: Annotated[bool, typer.Option(help="Deploy even when not promoted.")] = False,
) -> None:
    """Train every configuration of the grid as one job array and ship the best one.

    Example: `gpuferry run sweep --workload . --stack hpc --grid lr=0.01,0.1 --grid hidden=64,128`.
    """
    name, parameters = _training_parameters(workload, stack, hp, param, force_deploy)
    values = {}
    for item in grid or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"--grid {item!r}: write NAME=V1,V2,...")
        values[key.strip()] = grid_values(raw)
    if not values:
        raise fail("a sweep needs a grid: --grid NAME=V1,V2 (repeatable)")
    parameters["grid"] = {"values": values}
    if parallelism is not None:
        parameters["parallelism"] = parallelism
    start("sweep", deployment, name, parameters, local=local, follow_run=follow_run, pool=pool)


def grid_values(raw: str) -> list[Any]:
    """``0.1,0.3`` or ``[0.1, 0.3]`` → [0.1, 0.3]; a value that is not JSON stays a string."""
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, list):
        return parsed
    out: list[Any] = []
    for part in raw.split(","):
        try:
            out.append(json.loads(part))
        except json.JSONDecodeError:
            out.append(part.strip())
    return out


@run_app.command("deploy")
@explained
def run_deploy(
    model: Annotated[str, typer.Option("--model", "-m", help="The registered model.")],
    version: Annotated[str | None, typer.Option(help="The version (default: the alias's).")] = None,
    alias: Annotated[str, typer.Option(help="The alias used when no version is given.")] = "champion",
    stack: StackOption = None,
    local: LocalOption = False,
    follow_run: FollowOption = True,
    deployment: Annotated[
        str, typer.Option("--deployment", "-d", help="flow/name of the deployment.")
    ] = "deploy-model/on-champion",
) -> None:
    """Serve a registered model version on the stack's serving backend.

    Example: `gpuferry run deploy --model house-prices --version 3 --stack hpc` (a rollback by hand: the version
    serves with the shape it recorded).
    """
    check_stack_name(stack)
    parameters = {"model_name": model, "version": version, "alias": alias, "stack": stack or None}
    start("deploy-model", deployment, "on-champion", parameters, local=local, follow_run=follow_run)
    if follow_run and not local:
        from flows.retrain import load_stack

        tracking = load_stack(stack).tracking
        resolved, _ = tracking.resolve_version(model, version, None if version else alias)
        tags = tracking.version_tags(model, resolved)
        typer.echo(
            f"model version: {model} v{resolved}: {tags.get('deploy.status', 'no deploy recorded')}, "
            f"endpoint {tags.get('deploy.endpoint', '-')}"
        )
