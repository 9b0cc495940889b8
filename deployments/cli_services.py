"""The long-running parts as ``gpuferry`` commands, so that an installed gpuferry runs them all (no clone):

    gpuferry worker --pool gpuferry          the Prefect worker that runs the flows (deployments/worker.py)
    gpuferry watch                           the job watcher, for runs that wait suspended (deployments/job_watcher.py)
    gpuferry events --stack hpc ...          MLflow's registry events to Prefect: the webhook receiver
    gpuferry events --poll --stack hpc ...   ... or the registry poller, where webhooks are off

Each command hands its options to the service's own parser: ``gpuferry worker --help`` lists the worker's.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

# The options are the service's own, parsed by it: typer passes them through unread.
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _run(main: Callable[[list[str]], int], ctx: typer.Context) -> None:
    import sys

    sys.argv[0] = ctx.command_path  # what the service's parser calls itself in its usage and errors
    raise typer.Exit(main(list(ctx.args)) or 0)


def worker(ctx: typer.Context) -> None:
    """Run the Prefect worker that runs gpuferry's flows, from this installation (--pool NAME; --help for more).

    Example: `gpuferry worker --pool gpuferry`.
    """
    from deployments.worker import main

    _run(main, ctx)


def watch(ctx: typer.Context) -> None:
    """Watch the training jobs of runs that wait suspended, and resume each run when its job ends (--help).

    Example: `gpuferry watch --interval 10`.
    """
    from deployments.job_watcher import main

    _run(main, ctx)


def events(
    ctx: typer.Context,
    poll: bool = typer.Option(False, "--poll", help="Poll the registry instead of receiving MLflow's webhooks."),
) -> None:
    """Turn MLflow registry events (an alias set) into Prefect events: the webhook receiver, or with --poll the
    registry poller (--help for each one's options).

    Example: `gpuferry events --stack hpc --secret-block mlflow-webhook-secret --register`, or
    `gpuferry events --poll --stack hpc`.
    """
    if poll:
        from deployments.poll_registry import main
    else:
        from deployments.webhook import main
    _run(main, ctx)


def register(app: typer.Typer) -> None:
    for command in (worker, watch, events):
        app.command(command.__name__, context_settings=PASS_THROUGH, add_help_option=False)(command)
