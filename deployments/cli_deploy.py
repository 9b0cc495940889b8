"""``gpuferry deploy``: register the deployments with the Prefect server, from a clone or an installed gpuferry.

It runs ``prefect deploy`` on a copy of gpuferry's prefect.yaml (in the package: ``deployments/prefect.yaml``),
then gives each deployment of a workload that workload's own parameter form (``deployments/forms.py``).

* Without ``--workload``: every deployment of prefect.yaml, its bundled examples' included; their workloads are
  the examples shipped with gpuferry (``deployments/examples``), by absolute path, so it works as well from an
  installed gpuferry as from a clone.
* With ``--workload``: for each workload given, a ``retrain/<name>`` and a ``sweep/<name>`` deployment of it, on
  ``--stack`` by default; the retrain one on the workload's own schedule (``train.schedule`` in its
  ``gpuferry.yaml``, or ``--cron``). The deployments every team needs whatever it trains (``deploy-model/on-champion``
  for the event-driven deploy, ``provision/provision``, ``release/release``) are registered too where the server
  does not have them yet; one that exists is left as it is (another pool's worker may serve it).

The entrypoints (``flows/retrain.py:retrain``) are relative to the directory holding gpuferry's packages (the
checkout, or site-packages): ``prefect deploy`` runs there, and ``gpuferry worker`` runs the flows from there.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from blocks.errors import ConfigurationError
from deployments.cli_common import DEFAULT_POOL, PoolOption, StackOption
from deployments.skeleton import EXAMPLES_DIR

# The directory holding gpuferry's packages (the checkout, or site-packages when installed): prefect.yaml's
# entrypoints (flows/retrain.py) are relative to it.
REPO = Path(__file__).resolve().parent.parent
PREFECT_FILE = Path(__file__).with_name("prefect.yaml")  # the checkout's prefect.yaml, also in an installed package
WORKLOAD_FLOWS = ("retrain", "sweep")


def workload_source(path_or_url: str) -> str:
    """A workload as a deployment records it: a git URL as given, a local path made absolute."""
    return path_or_url if path_or_url.startswith("git+") else str(Path(path_or_url).expanduser().resolve())


def _entrypoints(config: dict[str, Any]) -> dict[str, str]:
    return {d["entrypoint"].rsplit(":", 1)[1]: d["entrypoint"] for d in config["deployments"]}


def shared_deployments(config: dict[str, Any]) -> list[dict[str, Any]]:
    """prefect.yaml's deployments that run no particular workload (deploy-model/on-champion, provision, release)."""
    return [d for d in config["deployments"] if "workload" not in (d.get("parameters") or {})]


def workload_deployments(
    config: dict[str, Any], sources: list[str], *, stack: str | None = None, cron: str | None = None, timezone: str = ""
) -> list[dict[str, Any]]:
    """A retrain and a sweep deployment of each workload, named after it, from prefect.yaml's entrypoints; the
    retrain one on ``cron`` (in ``timezone``), else on the workload's ``train.schedule``, else on none."""
    from blocks.workload.definition import ScheduleDefinition
    from blocks.workload.source import load_workload

    entry = _entrypoints(config)
    asked = ScheduleDefinition(cron=cron, timezone=timezone or "UTC") if cron else None
    out = []
    for source in sources:
        work = load_workload(source)
        schedule = asked or work.definition.train.schedule
        for flow in WORKLOAD_FLOWS:
            deployment: dict[str, Any] = {
                "name": work.name,
                "entrypoint": entry[flow],
                "description": f"{flow.capitalize()} {work.name} ({source}) on the stack given in `stack`.",
                "parameters": {"workload": source, "stack": stack},
            }
            if flow == "retrain" and schedule is not None:
                deployment["schedules"] = [{"cron": schedule.cron, "timezone": schedule.timezone}]
            out.append(deployment)
    return out


def bundled_deployments(config: dict[str, Any], examples: Path = EXAMPLES_DIR) -> list[dict[str, Any]]:
    """prefect.yaml's deployments, each example's workload by absolute path into ``examples``."""
    out = []
    for deployment in config["deployments"]:
        parameters = dict(deployment.get("parameters") or {})
        workload = parameters.get("workload")
        if isinstance(workload, str) and workload.startswith("examples/"):
            parameters["workload"] = str((examples / workload.removeprefix("examples/")).resolve())
        out.append({**deployment, "parameters": parameters})
    return out


def ensure_pool(pool: str) -> None:
    """Create the work pool (a process pool, as prefect.yaml's) when the server has none by that name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
            return
        except ObjectNotFound:
            pass
        client.create_work_pool(
            WorkPoolCreate(name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template())
        )
    typer.echo(f"created work pool {pool} (process): start a worker on it, `gpuferry worker --pool {pool}`")


def flow_of(entrypoint: str) -> str:
    """The name of the flow at ``flows/retrain.py:retrain`` (its @flow's)."""
    import importlib

    path, _, function = entrypoint.partition(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), function).name


def missing(deployments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Those of ``deployments`` the server does not have."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    out = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            try:
                client.read_deployment_by_name(f"{flow_of(deployment['entrypoint'])}/{deployment['name']}")
            except ObjectNotFound:
                out.append(deployment)
    return out


def prefect_deploy(config: dict[str, Any], deployments: list[dict[str, Any]], pool: str) -> list[str]:
    """``prefect deploy`` of ``deployments`` (prefect.yaml's ``config`` around them) on ``pool``, created when
    missing; the names registered (``flow/name``)."""
    ensure_pool(pool)
    config = {
        **config,
        "deployments": [{**d, "work_pool": {**d.get("work_pool", {}), "name": pool}} for d in deployments],
    }
    with tempfile.TemporaryDirectory(prefix="gpuferry-deploy-") as tmp:
        prefect_file = Path(tmp) / "prefect.yaml"
        prefect_file.write_text(yaml.safe_dump(config, sort_keys=False))
        done = subprocess.run(
            [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if done.returncode != 0:
        raise ConfigurationError(f"prefect deploy failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return [f"{flow_of(d['entrypoint'])}/{d['name']}" for d in deployments]


def register(sources: list[str], pool: str, *, stack: str | None = None) -> list[str]:
    """The workloads' own retrain and sweep deployments on ``pool`` (``gpuferry run`` registers a workload's
    this way the first time it runs it); the names registered."""
    config = yaml.safe_load(PREFECT_FILE.read_text())
    return prefect_deploy(config, workload_deployments(config, sources, stack=stack), pool)


def deploy(
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload",
            "-w",
            help="Register this workload's own "
            "retrain and sweep deployments (a path or git+URL@REF#subdirectory=PATH); repeatable.",
        ),
    ] = None,
    stack: StackOption = None,
    cron: Annotated[
        str | None,
        typer.Option(
            help="Retrain the workload on this schedule, a cron line ('0 3 * * 1': Mondays 03:00), over its "
            "gpuferry.yaml's train.schedule."
        ),
    ] = None,
    timezone: Annotated[str, typer.Option(help="The time zone --cron is read in (IANA: UTC, Europe/Berlin).")] = "UTC",
    pool: PoolOption = DEFAULT_POOL,
) -> None:
    """Register the deployments with the Prefect server, each workload's with its own parameter form.

    Example: `gpuferry deploy --workload ./house-prices --stack hpc --cron '0 3 * * 1'`.
    """
    from deployments.forms import apply_forms

    config = yaml.safe_load(PREFECT_FILE.read_text())
    sources = [workload_source(w) for w in workload or []]
    if stack:
        from blocks.stack import Stack

        Stack.named(stack)  # a name no stack has: the error lists the saved ones
    if cron and not sources:
        raise ConfigurationError("--cron schedules a workload's retrain: name the workload with --workload DIR")
    if sources:
        own = workload_deployments(config, sources, stack=stack, cron=cron, timezone=timezone)
        shared = shared_deployments(config)
        wanted = own + missing(shared)
        kept = [f"{flow_of(d['entrypoint'])}/{d['name']}" for d in shared if d not in wanted]
    else:
        wanted = bundled_deployments(config)
        if stack:
            wanted = [{**d, "parameters": {**d.get("parameters", {}), "stack": stack}} for d in wanted]
        kept = []
    names = prefect_deploy(config, wanted, pool)
    formed = apply_forms([n for n in names if n.split("/")[0] in WORKLOAD_FLOWS and _has_workload(n, wanted)])
    typer.echo(f"registered on work pool {pool}: {', '.join(names)}")
    if kept:
        typer.echo(f"already on the server, left as they are: {', '.join(kept)}")
    typer.echo(f"with their workload's form: {', '.join(formed) or 'none'}")
    for deployment in wanted:
        for schedule in deployment.get("schedules") or []:
            typer.echo(
                f"{flow_of(deployment['entrypoint'])}/{deployment['name']} runs on schedule "
                f"{schedule['cron']!r} ({schedule.get('timezone', 'UTC')})"
            )


def _has_workload(name: str, deployments: list[dict[str, Any]]) -> bool:
    return any(
        f"{flow_of(d['entrypoint'])}/{d['name']}" == name and (d.get("parameters") or {}).get("workload")
        for d in deployments
    )
