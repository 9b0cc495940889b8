"""deployments/worker.py: flow runs start in a process started (and its imports done) before they arrived.

Integration tests use the real Prefect server (scripts/prefect.sh), with a work pool, worker and copy of
the `provision` deployment of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deployments.worker import _project_files, _stale, direct_entrypoint
from tests import private_worker
from tests.stacks import stack_env

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 600.0  # seconds: a busy 2-core machine


def test_stale_sees_a_changed_or_removed_file(tmp_path: Path) -> None:
    one, two = tmp_path / "one.py", tmp_path / "two.py"
    one.write_text("x = 1\n")
    two.write_text("y = 2\n")
    files = {str(one): os.stat(one).st_mtime, str(two): os.stat(two).st_mtime}
    assert not _stale(files)
    os.utime(one, (os.stat(one).st_atime, os.stat(one).st_mtime + 5))
    assert _stale(files)
    files[str(one)] = os.stat(one).st_mtime
    two.unlink()
    assert _stale(files)


def test_project_files_are_the_checkouts_modules_not_the_environments() -> None:
    import prefect  # noqa: F401 - loaded from the environment (.venv inside the checkout

    import flows.provision  # noqa: F401 - loaded from the checkout

    files = _project_files(REPO)
    assert str(REPO / "flows" / "provision.py") in files
    assert not any(Path(f).resolve().is_relative_to(Path(sys.prefix).resolve()) for f in files)


def test_a_deployment_that_only_enters_the_code_dir_is_loaded_from_its_entrypoint(tmp_path: Path) -> None:
    """prefect.yaml's pull step, resolved as the flow-run process would resolve it, names the worker's code
    directory: the run may load ``path.py:flow`` at once. Anything else keeps the pull steps."""
    import yaml

    pull = yaml.safe_load((REPO / "prefect.yaml").read_text())["pull"]
    env = {"GPUFERRY_CODE_DIR": str(REPO)}
    entry = "flows/provision.py:provision"
    assert direct_entrypoint(entry, pull, env, REPO) == entry
    assert direct_entrypoint(entry, pull, {"GPUFERRY_CODE_DIR": str(tmp_path)}, REPO) is None  # another checkout
    assert direct_entrypoint(entry, pull, {}, REPO) is None  # unresolved
    assert direct_entrypoint("flows.provision.provision", pull, env, REPO) is None  # a module path
    assert direct_entrypoint(entry, None, env, REPO) is None  # no pull step: Prefect's own storage
    more = [*pull, {"prefect.deployments.steps.run_shell_script": {"script": "true"}}]
    assert direct_entrypoint(entry, more, env, REPO) is None
    variable = [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ prefect.variables.dir }}"}}]
    assert direct_entrypoint(entry, variable, env, REPO) is None
    literal = [{"prefect.deployments.steps.pull.set_working_directory": {"directory": str(REPO / "flows" / "..")}}]
    assert direct_entrypoint(entry, literal, {}, REPO) == entry


def run_logs(w: World, run_id: Any) -> list[str]:
    """The run's log lines on the server, once its last one ("Finished in state ...") arrived."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    def read() -> list[str] | None:
        with w.client() as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
        lines = [log.message for log in logs]
        return lines if any(line.startswith("Finished in state") for line in lines) else None

    return list(private_worker.wait_until("the run's logs", read, timeout=120, interval=1))


class World:
    def __init__(self, tmp: Path) -> None:
        self.api_url = stack_env("prefect")["PREFECT_API_URL"]
        self.uid = uuid.uuid4().hex[:8]
        self.tmp = tmp
        self.pool = f"gpuferry-standby-{self.uid}"
        self.env = private_worker.worker_env(self.api_url, tmp / "home")
        self.deployment = ""
        self.worker: subprocess.Popen[bytes] | None = None
        self.log = tmp / "worker.log"

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def standbys(self) -> list[int]:
        """The worker's children waiting as standby processes."""
        assert self.worker is not None
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.worker.pid and b"--standby" in cmdline:
                found.append(int(entry.name))
        return found

    def run(self, **parameters: Any) -> Any:
        with self.client() as client:
            dep = client.read_deployment_by_name(self.deployment)
            run = client.create_flow_run_from_deployment(dep.id, parameters=parameters)

        def ended() -> Any:
            with self.client() as client:
                current = client.read_flow_run(run.id)
            return current if current.state and current.state.is_final() else None

        return private_worker.wait_until("the run to end", ended, timeout=DEADLINE, interval=1)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    w = World(tmp_path)
    with temporary_settings({PREFECT_API_URL: w.api_url}):
        names = private_worker.render(tmp_path / "prefect.yaml", ["provision"], w.pool, w.uid)
        w.deployment = names["provision"]
        private_worker.deploy(tmp_path / "prefect.yaml", w.env, w.pool)
        w.worker = private_worker.start_worker(w.pool, f"standby-{w.uid}", w.env, w.log)
        try:
            yield w
        finally:
            private_worker.stop(w.worker)
            private_worker.remove(w.api_url, [w.deployment], w.pool)


@pytest.mark.integration
def test_a_run_starts_in_the_standby_process_and_a_new_one_replaces_it(world: World) -> None:
    w = world
    standby = private_worker.wait_until("a standby process", w.standbys, timeout=60)
    assert len(standby) == 1
    run = w.run(count=1, key=f"standby-{w.uid}")
    assert run.state.is_completed(), w.log.read_text()[-3000:]
    assert run.infrastructure_pid == str(standby[0]), (run.infrastructure_pid, standby)
    replacement = private_worker.wait_until(
        "the next standby process", lambda: [pid for pid in w.standbys() if pid not in standby], timeout=120
    )
    assert "starting a fresh engine" not in w.log.read_text()
    # The flow's file is not executed again: the engine takes the module the standby imported.
    assert f"standby process {standby[0]}: flows/provision.py: the module it preloaded" in w.log.read_text()
    # prefect.yaml's pull step only enters the worker's code directory: the run did not run it.
    assert not [line for line in run_logs(w, run.id) if "pull step" in line]

    # A deployment with a pull step of its own runs every step, in the next standby.
    from prefect.client.schemas.actions import DeploymentUpdate

    with w.client() as client:
        dep = client.read_deployment_by_name(w.deployment)
        steps = [*(dep.pull_steps or []), {"prefect.deployments.steps.run_shell_script": {"script": "true"}}]
        client.update_deployment(dep.id, DeploymentUpdate(pull_steps=steps))
    again = w.run(count=1, key=f"steps-{w.uid}")
    assert again.state.is_completed(), w.log.read_text()[-3000:]
    assert again.infrastructure_pid == str(replacement[0])
    assert "Running 2 deployment pull step(s)" in run_logs(w, again.id)


@pytest.mark.integration
def test_a_standby_whose_code_changed_runs_the_new_code_in_a_fresh_engine(world: World) -> None:
    w = world
    standby = private_worker.wait_until("a standby process", w.standbys, timeout=60)
    private_worker.wait_until(
        "the standby's imports", lambda: f"standby process {standby[0]}: ready" in w.log.read_text(), timeout=300
    )
    source = REPO / "flows" / "provision.py"
    before = os.stat(source)
    os.utime(source, (before.st_atime, before.st_mtime + 1))  # as an edit after the standby imported it
    try:
        run = w.run(count=1, key=f"stale-{w.uid}")
    finally:
        os.utime(source, (before.st_atime, before.st_mtime))
    assert run.state.is_completed(), w.log.read_text()[-3000:]
    assert "project files changed since its preload: starting a fresh engine" in w.log.read_text()


@pytest.mark.integration
def test_a_run_starts_when_the_server_schedules_it_not_at_the_next_poll(world: World) -> None:
    """A worker that polls every 600 s (Prefect jitters the interval by up to 30 %: the poll after its first comes
    420 s later at the earliest) starts a run created after its first poll within seconds: the server's event for
    the scheduled run wakes it."""
    w = world
    private_worker.stop(w.worker)
    env = {**w.env, "PREFECT_WORKER_QUERY_SECONDS": "600"}
    w.worker = private_worker.start_worker(w.pool, f"woken-{w.uid}", env, w.log)  # it polls once, now
    standby = private_worker.wait_until("a standby process", w.standbys, timeout=60)
    private_worker.wait_until(
        "the standby's imports", lambda: f"standby process {standby[0]}: ready" in w.log.read_text(), timeout=300
    )
    run = w.run(count=1, key=f"woken-{w.uid}")
    assert run.state.is_completed(), w.log.read_text()[-3000:]
    waited = (run.start_time - run.created).total_seconds()
    assert waited < 120, (waited, w.log.read_text()[-3000:])  # far from the 420 s a poll would take
