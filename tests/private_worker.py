"""A private work pool, worker and deployments on the shared Prefect server, for one test or benchmark run.

The Prefect stack's server is shared: a test that must kill its worker, or a benchmark that must run
this checkout's code, registers copies of prefect.yaml's deployments under unique names on a work
pool of its own, and starts its own worker (this checkout's ``deployments/worker.py``, as
scripts/prefect.sh starts it; or Prefect's plain process worker).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


def render(prefect_file: Path, names: list[str], pool: str, suffix: str, alias: str | None = None) -> dict[str, str]:
    """Write the deployments ``names`` of prefect.yaml to ``prefect_file``, renamed ``<name>-<suffix>`` and on
    ``pool``; event triggers match alias ``alias`` instead (so they do not fire for the real one).
    Returns name -> ``<flow>/<new name>``."""
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    chosen, full = [], {}
    for deployment in config["deployments"]:
        if deployment["name"] not in names:
            continue
        new = f"{deployment['name']}-{suffix}"
        module, _, function = deployment["entrypoint"].partition(":")
        full[deployment["name"]] = f"{flow_name(module, function)}/{new}"
        deployment = {**deployment, "name": new, "work_pool": {**deployment["work_pool"], "name": pool}}
        deployment.pop("schedules", None)  # a private copy runs only when asked
        triggers = []
        for trigger in deployment.get("triggers", []):
            trigger = {**trigger, "name": f"{trigger['name']}-{suffix}"}
            if alias is not None:
                trigger["match"] = {**trigger["match"], "alias": alias}
            triggers.append(trigger)
        if triggers:
            deployment["triggers"] = triggers
        chosen.append(deployment)
    missing = set(names) - {d["name"].removesuffix(f"-{suffix}") for d in chosen}
    if missing:
        raise ValueError(f"prefect.yaml has no deployment named {sorted(missing)}")
    prefect_file.write_text(yaml.safe_dump({**config, "deployments": chosen}, sort_keys=False))
    return full


def flow_name(module_path: str, function: str) -> str:
    """The flow's name as the @flow decorator gives it (read from the source, nothing imported)."""
    import ast

    tree = ast.parse((REPO / module_path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call):
                    for kw in deco.keywords:
                        if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                            return str(kw.value.value)
            return function.replace("_", "-")
    raise ValueError(f"{module_path} has no function {function}")


def deploy(prefect_file: Path, env: dict[str, str], pool: str) -> None:
    """Create the process work pool ``pool`` and register the deployments of ``prefect_file`` on it."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template), overwrite=True)
    done = subprocess.run(
        [str(REPO / ".venv/bin/prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"prefect deploy failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def worker_env(api_url: str, home: Path) -> dict[str, str]:
    """The environment scripts/prefect.sh gives its worker, with this checkout as the code directory."""
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "GPUFERRY_CODE_DIR": str(REPO),
        "GPUFERRY_HOME": str(home),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PREFECT_HOME", None)
    return env


def start_worker(
    pool: str,
    name: str,
    env: dict[str, str],
    log: Path,
    kind: str = "standby",
    new_session: bool = False,
    argv: list[str] | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen[bytes]:
    """Start a worker for ``pool`` (created if missing) and wait until the server lists it.

    ``new_session``: the worker leads a process group of its own (with the flow-run processes it starts),
    which ``os.killpg`` can kill at once. ``argv``: another command than this checkout's worker (an installed
    gpuferry's), started in ``cwd``."""
    kinds = {
        "standby": [
            sys.executable,
            "-m",
            "deployments.worker",
            "--pool",
            pool,
            "--name",
            name,
            "--code-dir",
            str(REPO),
        ],
        "process": [str(REPO / ".venv/bin/prefect"), "worker", "start", "--pool", pool, "--type", "process"],
    }
    if argv is None and kind not in kinds:
        raise ValueError(f"kind={kind!r}: use 'standby' (deployments/worker.py) or 'process' (Prefect's)")
    argv = argv or kinds[kind] + (["--name", name] if kind == "process" else [])
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session
        )

    def listed() -> bool:
        from prefect.client.orchestration import SyncPrefectClient

        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited ({proc.returncode}): {log.read_text()[-3000:]}")
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            try:
                return any(w.name == name for w in client.read_workers_for_work_pool(pool))
            except Exception:  # noqa: BLE001 - the pool is created by the worker's first poll
                return False

    wait_until(f"worker {name} to register", listed, timeout=180)
    return proc


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 60) -> None:
    """SIGTERM ``proc``; SIGKILL if it has not exited after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def remove(api_url: str, deployments: list[str], pool: str) -> None:
    """Delete the private deployments and pool (best effort: the shared server keeps no leftovers)."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        for name in deployments:
            try:
                client.delete_deployment(client.read_deployment_by_name(name).id)
            except Exception as exc:  # noqa: BLE001 - best effort: printed, the test goes on
                print(f"cleanup: deployment {name}: {exc}")
        try:
            client.delete_work_pool(pool)
        except Exception as exc:  # noqa: BLE001
            print(f"cleanup: work pool {pool}: {exc}")


def wait_until(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
