"""Mark a flow run Crashed when its process died with its worker (machine lost, container evicted, kill -9).

When a worker dies together with its flow-run process, nothing is left to report the run's end: the
server keeps it Running. Every flow run sends a heartbeat event (``prefect.flow-run.heartbeat``,
every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, default 180); this registers the automation
Prefect documents for self-hosted servers ("detect zombie flows"): after a heartbeat, when neither
another heartbeat nor an end of the run (completed, failed, cancelled, crashed, paused or suspended:
a suspended run holds no process and beats no more) arrives within ``within`` seconds, the run is
set Crashed. A crashed run can then be retried (the UI's Retry, or ``AwaitingRetry``): the retried
run has the same id, so its steps find what the first attempt made (the Slurm job is adopted by its
key, not submitted again).

``within`` must exceed the heartbeat interval of every run the automation covers, with margin for a
loaded machine: the default, 360 s, covers Prefect's default interval (180 s). Registration is
idempotent by name; ``--deployment`` limits it to one deployment's runs.

    python -m deployments.crashed_runs [--within 360] [--name NAME] [--deployment ID ...]
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Any, cast

DEFAULT_NAME = "gpuferry: crash flow runs whose heartbeat stopped"
DEFAULT_WITHIN_S = 360
# A run that reached one of these has ended, or waits without a process: no heartbeat is expected after it.
QUIET_STATES = ("Completed", "Failed", "Cancelled", "Crashed", "Paused", "Suspended")


def automation(
    name: str = DEFAULT_NAME, within_s: int = DEFAULT_WITHIN_S, deployment_ids: list[str] | None = None
) -> Any:
    """The automation (not yet registered)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    if within_s < 60:
        raise ValueError(f"within={within_s}: give at least 60 s (runs beat at most every 30 s)")
    related: Any = {}
    if deployment_ids:
        related = ResourceSpecification(
            {
                "prefect.resource.id": [f"prefect.deployment.{d}" for d in deployment_ids],
                "prefect.resource.role": "deployment",
            }
        )
    return Automation(
        name=name,
        description="A flow run that stopped sending heartbeats without ending is marked Crashed (its process ended).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in QUIET_STATES)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=related,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {within_s} s: the flow run's process is gone (its worker or machine died).",
            )
        ],
    )


def ensure(name: str = DEFAULT_NAME, within_s: int = DEFAULT_WITHIN_S, deployment_ids: list[str] | None = None) -> Any:
    """Register the automation, or bring the one already registered under ``name`` up to date."""
    from prefect.automations import Automation

    wanted = automation(name, within_s, deployment_ids)
    try:
        existing = cast(Automation, Automation.read(name=name))  # sync here: Prefect types it as a coroutine too
    except ValueError:  # not registered yet
        return cast(Automation, wanted.create())
    wanted.id = existing.id
    wanted.update()
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=DEFAULT_NAME, help="the automation's name (it is updated if it exists)")
    parser.add_argument(
        "--within",
        type=int,
        default=DEFAULT_WITHIN_S,
        help="seconds without a heartbeat before a run is crashed (> the runs' heartbeat interval)",
    )
    parser.add_argument("--deployment", action="append", default=None, help="only this deployment's runs (id)")
    args = parser.parse_args(argv)
    try:
        created = ensure(args.name, args.within, args.deployment)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"automation {created.name!r} ({created.id}): crash after {args.within} s without a heartbeat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
