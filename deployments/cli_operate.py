"""Operating what runs and what serves.

``gpuferry runs`` lists the recent flow runs with what each says of itself (its stack, its training job, the model
version it registered: labels the flows set, tasks/waiting.py), ``gpuferry logs RUN`` prints a run's logs
(``--follow`` to its end), ``gpuferry cancel RUN`` cancels its training job on the stack's compute backend and then
the run itself. ``gpuferry services`` shows what each service of a stack serves now, and ``gpuferry rollback``
serves an earlier version again and moves the alias back to it, so the event-driven deploy does not bring the bad
one back.

``rollback`` runs the ``deploy-model`` flow in this process (its run is on the Prefect server like any other): the
earlier version serves as it was registered (its service, its image, its shape: ``gpuferry.serving``), through the
serving backend's usual gate and rollout. Only once it serves does the alias move; the version rolled back from is
tagged ``rollback.to`` / ``rollback.at`` in MLflow.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from blocks.errors import ConfigurationError
from deployments.cli_common import StackOption, console, explained


def _stack(stack: str | None) -> Any:
    from blocks.stack import load_stack

    return load_stack(stack)


@explained
def services(
    stack: StackOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the services as JSON.")] = False,
) -> None:
    """Each service the stack's serving backend runs: the model version serving, its address, replicas and GPUs.

    Example: `gpuferry services --stack hpc`.
    """
    blocks = _stack(stack)
    rows = []
    for name in blocks.serving.services():
        now = blocks.serving.current(name) or {}
        replicas = now.get("replicas")
        rows.append(
            {
                "service": name,
                "model": now.get("model_name"),
                "version": now.get("version"),
                "url": now.get("url"),
                "replicas": f"{now.get('available_replicas', 0)}/{replicas}" if replicas is not None else "1",
                "gpus": now.get("gpus") or "",
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table("service", "model", "version", "url", "ready/replicas", "GPUs")
    for row in rows:
        table.add_row(*(str(row[k] or "") for k in ("service", "model", "version", "url", "replicas", "gpus")))
    console().print(table)
    if not rows:
        typer.echo(f"nothing serves on {type(blocks.serving).__name__}")


@explained
def rollback(
    service: Annotated[str, typer.Argument(help="The service (`gpuferry services` lists them).")],
    to: Annotated[str | None, typer.Option("--to", help="The version to serve (default: the one before).")] = None,
    stack: StackOption = None,
    alias: Annotated[str, typer.Option(help="The alias that moves back to it (the event-driven deploy's).")] = (
        "champion"
    ),
) -> None:
    """Serve an earlier version of SERVICE again, with the shape it was registered with, and move the alias back.

    Example: `gpuferry rollback house-prices --stack hpc` (the version that served before), or `--to 3`.
    """
    from flows.deploy_model import deploy_model

    blocks = _stack(stack)
    now = blocks.serving.current(service)
    if now is None:
        raise ConfigurationError(
            f"no version of {service!r} serves on the stack's {type(blocks.serving).__name__}: "
            "`gpuferry services` lists what does"
        )
    model, bad = now.get("model_name"), str(now.get("version"))
    if not model:
        raise ConfigurationError(f"{service!r} does not say which model it serves: give --to and deploy it by hand")
    tracking = blocks.tracking
    target = to or tracking.version_tags(model, bad).get("deploy.previous_version")
    if not target:
        raise ConfigurationError(
            f"{model} v{bad} records no version that served before it: give the version to serve, --to VERSION"
        )
    if str(target) == bad:
        raise ConfigurationError(f"{model} v{bad} already serves {service!r}: give another version, --to VERSION")
    typer.echo(f"{service}: serving {model} v{target} again (was v{bad})")
    endpoint = deploy_model(model_name=model, version=str(target), alias=None, stack=stack or None)
    tracking.set_alias(model, alias, str(target))
    at = datetime.now(UTC).isoformat(timespec="seconds")
    for key, value in (("rollback.to", str(target)), ("rollback.at", at)):
        tracking.client.set_model_version_tag(model, bad, key, value)
    url = endpoint.url if endpoint is not None else now.get("url")
    typer.echo(f"{service}: v{target} serves at {url}; alias {alias!r} points at v{target}; v{bad} tagged rollback.to")


RunArgument = Annotated[str, typer.Argument(help="The flow run: its name (`gpuferry runs` lists them) or its id.")]


def find_run(client: Any, run: str) -> Any:
    """The flow run named ``run`` (or with that id); a clear error when there is none, or several."""
    from uuid import UUID

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = UUID(run)
    except ValueError:
        found = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run])), limit=2)
        if len(found) == 1:
            return found[0]
        if found:
            raise ConfigurationError(
                f"several flow runs are named {run!r}: give its id (`gpuferry runs --json`)"
            ) from None
        raise ConfigurationError(f"no flow run is named {run!r}: `gpuferry runs` lists the recent ones") from None
    try:
        return client.read_flow_run(run_id)
    except ObjectNotFound:
        raise ConfigurationError(f"no flow run has the id {run}: `gpuferry runs` lists the recent ones") from None


def run_row(run: Any, flow_names: dict[Any, str]) -> dict[str, Any]:
    from tasks.waiting import RUN_JOB_LABEL, RUN_MODEL_LABEL, RUN_STACK_LABEL

    labels = dict(run.labels or {})
    job = ""
    if labels.get(RUN_JOB_LABEL):
        handle = json.loads(labels[RUN_JOB_LABEL])
        job = f"{handle.get('backend', '')} {handle.get('job_id', '')}".strip()
    started = run.start_time or run.expected_start_time
    return {
        "id": str(run.id),
        "name": run.name,
        "final": bool(run.state and run.state.is_final()),
        "flow": flow_names.get(run.flow_id, ""),
        "state": run.state.name if run.state else "",
        "started": started.isoformat(timespec="seconds") if started else "",
        "seconds": round(run.total_run_time.total_seconds()) if run.total_run_time else 0,
        "stack": labels.get(RUN_STACK_LABEL, "") if RUN_STACK_LABEL in labels else "",
        "job": job,
        "handle": labels.get(RUN_JOB_LABEL, ""),
        "job_state": "",
        "model_version": labels.get(RUN_MODEL_LABEL, ""),
    }


def add_job_states(rows: list[dict[str, Any]]) -> None:
    """The queue state of each live run's job (PENDING and the scheduler's reason, RUNNING and its nodes), in
    ``job_state``: ONE poll per stack for all its jobs. A stack that does not answer gets its error, in short."""
    from blocks.errors import GpuferryError
    from blocks.records import JobHandle

    per_stack: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["handle"] and not row["final"]:
            per_stack.setdefault(row["stack"], []).append(row)
    for stack, rows_of_stack in per_stack.items():
        try:
            compute = _stack(stack or None).compute
            handles = [JobHandle.model_validate_json(row["handle"]) for row in rows_of_stack]
            # A job of another backend (the stack changed since) is not this backend's to poll.
            live = [row for row, h in zip(rows_of_stack, handles, strict=True) if h.backend == compute.backend_name]
            handles = [h for h in handles if h.backend == compute.backend_name]
            statuses = compute.poll(handles)
        except GpuferryError as exc:
            for row in rows_of_stack:
                row["job_state"] = f"? ({str(exc).splitlines()[0][:120]})"
            continue
        for row, handle in zip(live, handles, strict=True):
            row["job_state"] = statuses[handle.job_id].summary()


@explained
def runs(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many runs, newest first.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON.")] = False,
    scheduled: Annotated[
        bool, typer.Option("--scheduled", help="Also the runs a schedule has planned for later.")
    ] = False,
) -> None:
    """The recent flow runs: flow, state, start, stack, training job (its queue state while the run lives: PENDING
    and the scheduler's reason, RUNNING and its nodes) and the model version each registered. Runs a schedule
    planned for later are left out unless `--scheduled`.

    Example: `gpuferry runs -n 5`.
    """
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterId, FlowRunFilter, FlowRunFilterExpectedStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    due = (
        None
        if scheduled
        else FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(before_=datetime.now(UTC)))
    )
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(flow_run_filter=due, sort=FlowRunSort.START_TIME_DESC, limit=limit)
        ids = list({r.flow_id for r in found})
        flows = client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=ids))) if ids else []
    names = {f.id: f.name for f in flows}
    rows = [run_row(r, names) for r in found]
    add_job_states(rows)
    for row in rows:
        del row["handle"], row["final"]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table("run", "flow", "state", "started", "stack", "job", "model version")
    for row in rows:
        table.add_row(
            row["name"],
            row["flow"],
            row["state"],
            row["started"],
            row["stack"] or "(embedded)",
            f"{row['job']}: {row['job_state']}" if row["job_state"] else row["job"],
            row["model_version"],
        )
    console().print(table)
    if not rows:
        typer.echo("no flow runs on this Prefect server yet")


@explained
def logs(
    run: RunArgument,
    follow_run: Annotated[bool, typer.Option("--follow", "-f", help="Go on printing until the run ends.")] = False,
) -> None:
    """A flow run's logs (its tasks' too), oldest first; `--follow` prints them as they come until the run ends.

    Example: `gpuferry logs clever-fox -f`.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from deployments.cli_run import follow, level_name

    with get_client(sync_client=True) as client:
        found = find_run(client, run)
        if follow_run:
            final = follow(found.id)
            typer.echo(f"{final.name}: {final.state.name if final.state else '?'}")
            return
        offset = 0
        while True:
            page = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[found.id])),
                offset=offset,
                sort=LogSort.TIMESTAMP_ASC,
                limit=200,
            )
            for entry in page:
                typer.echo(f"{entry.timestamp:%H:%M:%S} {level_name(entry.level)} {entry.message}")
            offset += len(page)
            if len(page) < 200:
                break


@explained
def cancel(run: RunArgument) -> None:
    """Cancel a flow run, and its training job on the stack it runs on.

    A run a worker or `serve` started is stopped by it (and its own training task cancels the job too); a run
    suspended while its job runs (`suspend`), or one started in another process, has only this to stop its job.

    Example: `gpuferry cancel clever-fox`.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import State
    from prefect.states import Cancelled, Cancelling

    from blocks.records import JobHandle
    from tasks.waiting import RUN_JOB_LABEL, RUN_STACK_LABEL

    with get_client(sync_client=True) as client:
        found = find_run(client, run)
        if found.state is not None and found.state.is_final():
            typer.echo(f"{found.name} already ended: {found.state.name}")
            return
        # The run first, then its job: a job cancelled first would end the run Failed (its training task sees the
        # job end) before the run is marked. A run a worker or runner started is asked to stop (it watches for
        # Cancelling, stops the run's process and sets it Cancelled); any other (scheduled, suspended, paused, or
        # running in a process of its own) is Cancelled at once: the server then refuses its process any further
        # state, which ends it.
        message = "cancelled with `gpuferry cancel`"
        watched = found.state is not None and found.state.is_running() and found.deployment_id is not None
        state: State[Any] = Cancelling(message=message) if watched else Cancelled(message=message)
        client.set_flow_run_state(found.id, state, force=True)
        typer.echo(f"{found.name}: {state.name}")
        labels = dict(found.labels or {})
        if labels.get(RUN_JOB_LABEL):
            handle = JobHandle.model_validate_json(labels[RUN_JOB_LABEL])
            blocks = _stack(labels.get(RUN_STACK_LABEL) or None)
            blocks.compute.cancel(handle)
            typer.echo(f"{found.name}: cancelled its training job {handle.job_id} on {handle.backend}")


def _size(size: int) -> str:
    amount = float(size)
    for unit in ("B", "KiB", "MiB"):
        if amount < 1024:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} GiB"


@explained
def gc(
    stack: StackOption = None,
    older_than: Annotated[
        float, typer.Option("--older-than", min=0, help="Only what was last written (or used) this many days ago.")
    ] = 30,
    apply: Annotated[bool, typer.Option("--apply", help="Free it (without: list what would be freed).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """Free what no registered version and no running job uses: stored checkpoints, job directories, code, images.

    A dry run by default: it lists what it would free; `--apply` frees it. Example: `gpuferry gc --stack hpc
    --older-than 14`, then `gpuferry gc --stack hpc --older-than 14 --apply`.
    """
    import time

    from blocks.housekeeping import collect, garbage

    blocks = _stack(stack)
    items = garbage(blocks, older_than)
    total = sum(i.size_bytes for i in items)
    if as_json:
        typer.echo(json.dumps([i.model_dump() for i in items], indent=2))
    else:
        from rich.table import Table

        table = Table("kind", "where", "size", "days old")
        for item in items:
            table.add_row(item.kind, item.where, _size(item.size_bytes), f"{(time.time() - item.modified) / 86400:.1f}")
        console().print(table)
    if not apply:
        typer.echo(f"would free {_size(total)} in {len(items)} items: run again with --apply to free them", err=True)
        return
    freed = collect(blocks, items)
    typer.echo(f"freed {_size(freed)} in {len(items)} items", err=True)


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)
    app.command("logs")(logs)
    app.command("cancel")(cancel)
    app.command("services")(services)
    app.command("rollback")(rollback)
    app.command("gc")(gc)
