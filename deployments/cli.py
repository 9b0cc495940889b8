"""The ``gpuferry`` command: stacks from a file, a check of every backend, runs, deployments and a new workload.

    gpuferry init [DIR]                         a workload skeleton (gpuferry.yaml, train.py, requirements, Dockerfile)
    gpuferry stack apply FILE [--dry-run]       save the stacks a file declares (only what changed)
    gpuferry stack list | show NAME             the saved stacks (secrets masked)
    gpuferry check [STACK] [--workload DIR]     contact every backend of the stack; one table, exit 1 on a failure
    gpuferry deploy [--workload DIR] [--cron]   register the deployments, each workload with its form (cli_deploy.py)
    gpuferry run retrain|sweep|deploy ...       a run through its deployment (or --local), followed to its end
    gpuferry services | rollback SERVICE        what serves where; an earlier version again (cli_operate.py)
    gpuferry serve MODEL                        a model on this machine, in the foreground (cli_serve.py)
    gpuferry worker | watch | events ...        the long-running services (deployments/cli_services.py)

The checks live in the blocks (``blocks/checks.py`` and each block's ``self_check``); this module renders
them. Exit codes: 0 done, 1 a check or run failed, 2 bad input (the message names the field and the fix).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from blocks.errors import ConfigurationError, GpuferryError
from deployments.cli_common import DEBUG, DEFAULT_POOL, PoolOption, console, explained, unreachable

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    name="gpuferry",
    help="From your training code to a served model: stacks, checks, runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings=HELP_OPTIONS,
)
stack_app = typer.Typer(
    help="Stacks declared in a YAML file, saved as Prefect blocks.", no_args_is_help=True, context_settings=HELP_OPTIONS
)
app.add_typer(stack_app, name="stack")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"gpuferry {version('gpuferry')}")
        except PackageNotFoundError:  # a checkout run without installing it
            typer.echo("gpuferry (not installed: a checkout)")
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="GPUFERRY_DEBUG", help="Show a failure's traceback too.")
    ] = False,
) -> None:
    """From your training code to a served model: stacks, checks, runs.

    Examples: `gpuferry init house-prices`, `gpuferry stack apply stack.yaml`, `gpuferry check hpc --workload
    house-prices`, `gpuferry run retrain --workload house-prices --stack hpc`.
    """
    DEBUG["on"] = debug or DEBUG["on"]


# ---- stack -----------------------------------------------------------------------------------------------


@stack_app.command("apply")
@explained
def stack_apply(
    file: Annotated[Path, typer.Argument(help="The stack file (YAML).")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; save nothing.")] = False,
) -> None:
    """Save each stack FILE declares, with its nested blocks; only a stack that changed is saved.

    Example: `gpuferry stack apply stack.yaml --dry-run`, then without --dry-run.
    """
    from blocks.stack_file import apply, load_stack_file

    results = apply(load_stack_file(file), dry_run=dry_run)
    would = "would be " if dry_run else ""
    for result in results:
        if result.action == "unchanged":
            typer.echo(f"{result.name}: unchanged")
        elif result.action == "created":
            typer.echo(f"{result.name}: {would}created")
        else:
            typer.echo(
                f"{result.name}: {would}updated ({len(result.changes)} change{'s' * (len(result.changes) != 1)})"
            )
            for change in result.changes:
                typer.echo(f"  {change}")
    if dry_run:
        typer.echo("dry run: nothing saved")


@stack_app.command("list")
@explained
def stack_list() -> None:
    """The saved stacks and the backend of each step.

    Example: `gpuferry stack list`.
    """
    from rich.table import Table

    from blocks.stack import STEPS, Stack

    names = Stack.saved_names()
    if not names:
        typer.echo("no saved stacks: `gpuferry stack apply FILE` saves the stacks a file declares")
        return
    table = Table("name", *STEPS)
    for name in names:
        stack = Stack.load(name)
        table.add_row(name, *(type(getattr(stack, step)).__name__ for step in STEPS))
    console().print(table)


@stack_app.command("show")
@explained
def stack_show(name: Annotated[str, typer.Argument(help="A saved stack.")]) -> None:
    """The saved stack NAME as a stack file declares it (fields not at their default; secrets masked).

    Example: `gpuferry stack show hpc > hpc.yaml`.
    """
    from blocks.stack import Stack
    from blocks.stack_file import describe

    stack = Stack.named(name)
    typer.echo(yaml.safe_dump({"stacks": {name: describe(stack)}}, sort_keys=False).rstrip())


# ---- check -----------------------------------------------------------------------------------------------


def resolve_stack(name: str | None, file: Path | None) -> tuple[str, Any]:
    """(label, Stack) for ``check``: a stack of FILE, a saved one, or the embedded stack."""
    from blocks.stack import Stack

    if file is not None:
        from blocks.stack_file import load_stack_file

        stacks = load_stack_file(file)
        if name is None and len(stacks) == 1:
            name = next(iter(stacks))
        if name not in stacks:
            raise ConfigurationError(f"{file} declares {', '.join(stacks)}: name one of them")
        return name, stacks[name]
    if not name:
        return "embedded", Stack.embedded()
    return name, Stack.named(name)


def workload_group(stack: Any, source: str, timeout: float) -> tuple[Any, Callable[[Any], None]]:
    """The checks of a workload, as a group ``Stack.check`` runs beside the backends': its file loads, and a run
    of it with its defaults is planned and checked against the stack (every check that needs no outside call, as
    retrain does before it acquires anything)."""
    # Imported before the group's deadline starts: on a cold start (no bytecode cache, a busy machine) importing
    # the flows alone can take longer than a backend is given to answer.
    from blocks.checks import Probe
    from blocks.plan import plan_run, preflight
    from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
    from blocks.workload.source import load_workload

    def checks(probe: Probe) -> None:
        found: list[Any] = []

        def load() -> str:
            found.append(load_workload(source))
            work = found[0]
            return (
                f"{work.name} from {work.root} ({work.code.files} files, {len(work.definition.schema.names)} "
                "hyperparameters)"
            )

        if not probe.step("gpuferry.yaml", load, "fix what the message names in the workload's gpuferry.yaml"):
            return

        def plan() -> str:
            run = plan_run(found[0], TrainingSpec(), ServingSpec(), PromotionPolicy())
            preflight(stack, run)
            return (
                f"a run with the defaults fits the stack ({run.resources.nodes} node(s), "
                f"{run.resources.gpus_per_node} GPU(s) per node)"
            )

        probe.step("run plan", plan, "change the workload's resources or image, or the stack's backends")

    return Probe("workload", Path(source).name or source, timeout=timeout), checks


def render_rows(rows: list[Any]) -> None:
    from rich.table import Table

    marks = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "failed": "[red]FAILED[/]", "skipped": "[dim]skipped[/]"}
    table = Table("step", "backend", "check", "status", "found", "fix", show_lines=False)
    for row in rows:
        table.add_row(row.step, row.backend, row.check, marks[row.status], row.detail, row.fix)
    console().print(table)


@app.command("check")
@explained
def check(
    stack: Annotated[str | None, typer.Argument(help="A saved stack (none: the embedded stack).")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Check a stack of this file, unsaved.")] = None,
    workload: Annotated[str | None, typer.Option("--workload", "-w", help="Also check this workload.")] = None,
    pool: PoolOption = DEFAULT_POOL,
    timeout: Annotated[float, typer.Option(help="Seconds each backend's checks may take.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
    prefect: Annotated[bool, typer.Option(help="Check the Prefect server, the pool and a worker.")] = True,
) -> None:
    """Contact every backend of STACK, all at once, and print what works, what does not, and the fix.

    Example: `gpuferry check hpc --workload . --timeout 30`.
    """
    from deployments.prefect_check import prefect_group

    started = time.monotonic()
    label, chosen = resolve_stack(stack, file)
    more = [prefect_group(pool, timeout)] if prefect else []
    if workload is not None:
        more.append(workload_group(chosen, workload, timeout))
    rows = chosen.check(timeout=timeout, more=more)
    seconds = time.monotonic() - started
    failed = [r for r in rows if r.failed]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "stack": label,
                    "ok": not failed,
                    "seconds": round(seconds, 2),
                    "rows": [r.model_dump() for r in rows],
                },
                indent=2,
            )
        )
    else:
        render_rows(rows)
        verdict = f"{len(failed)} check(s) failed" if failed else "all checks passed"
        typer.echo(f"stack {label}: {verdict} ({len(rows)} checks in {seconds:.1f} s)")
    if failed:
        raise typer.Exit(1)


# ---- the other commands ------------------------------------------------------------------------------------


def _register() -> None:
    from deployments import cli_deploy, cli_operate, cli_rollout, cli_run, cli_serve, cli_services, skeleton

    app.command("init")(explained(skeleton.init))
    app.command("deploy")(explained(cli_deploy.deploy))
    app.command("serve")(cli_serve.serve)
    app.add_typer(cli_run.run_app, name="run")
    cli_services.register(app)
    cli_operate.register(app)
    app.add_typer(cli_rollout.rollout_app, name="rollout")


_register()


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Without PREFECT_API_URL, --local runs start a temporary server: give a busy machine time to start it.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    try:
        app()
    except GpuferryError as exc:  # a problem the blocks explain: say it, without a traceback
        if DEBUG["on"]:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2 if isinstance(exc, ConfigurationError) else 1)
    except Exception as exc:
        message = unreachable(exc)
        if message is None or DEBUG["on"]:
            raise
        typer.echo(f"error: {message}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
