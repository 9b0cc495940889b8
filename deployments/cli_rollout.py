"""`gpuferry rollout`: a canary's or shadow's window under way, seen and decided by hand.

The deploy that runs the window (``serve.rollout``) keeps its state where the serving backend keeps the
service's routing (a Docker service's front) and asks it every second whether someone decided: ``promote``
ends the window with a pass, ``abort`` with a failure; either is recorded on the model version
(``deploy.rollout.decided_by_hand``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from blocks.errors import ConfigurationError
from deployments.cli_common import StackOption, explained

rollout_app = typer.Typer(
    help="A canary's or shadow's window under way: its state, and promote or abort by hand.",
    no_args_is_help=True,
)

ServiceArgument = Annotated[str, typer.Argument(help="The service (`gpuferry services` lists them).")]


def _serving(stack: str | None, service: str) -> Any:
    from blocks.stack import load_stack

    serving = load_stack(stack).serving
    if serving.current(service) is None:
        raise ConfigurationError(
            f"no version of {service!r} serves on the stack's {type(serving).__name__}: "
            "`gpuferry services` lists what does"
        )
    return serving


@rollout_app.command("status")
@explained
def status(
    service: ServiceArgument,
    stack: StackOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
) -> None:
    """The window under way for SERVICE: the new version, its strategy and share, the seconds gone, the requests it
    answered and the share that failed (as of its last report, every 10 s).

    Example: `gpuferry rollout status house-prices --stack hpc`.
    """
    state = _serving(stack, service).rollout_status(service)
    if as_json:
        typer.echo(json.dumps(state))
        return
    if state is None:
        typer.echo(f"{service}: no canary or shadow window is under way")
        return
    done = f", {state['seconds']} s of {state['window_seconds']:g}" if "seconds" in state else ""
    counts = (
        f", {state['answered']} requests answered, {100 * state['error_rate']:.1f} % failed"
        if "answered" in state
        else ""
    )
    typer.echo(
        f"{service}: v{state['version']} in a {state['strategy']} at {state['share']:g} against "
        f"v{state['serving_version']}, since {state['started_at']}{done}{counts}"
    )


def _decide(service: str, stack: str | None, decision: str) -> None:
    _serving(stack, service).decide_rollout(service, decision)
    typer.echo(f"{service}: {decision} asked; the deploy reads it at its next check (every second)")


@rollout_app.command("promote")
@explained
def promote(service: ServiceArgument, stack: StackOption = None) -> None:
    """End SERVICE's window now with a pass: the new version takes over (and the alias moves to it).

    Example: `gpuferry rollout promote house-prices --stack hpc`.
    """
    _decide(service, stack, "promote")


@rollout_app.command("abort")
@explained
def abort(service: ServiceArgument, stack: StackOption = None) -> None:
    """End SERVICE's window now with a failure: the new version is removed, the serving one keeps every request.

    Example: `gpuferry rollout abort house-prices --stack hpc`.
    """
    _decide(service, stack, "abort")
