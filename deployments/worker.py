"""Prefect's process worker, with the next flow-run process already started.

A process worker starts a new Python process for each flow run, and that process spends seconds
importing Prefect and the flow's modules before the run even starts: most of the time between an
MLflow event and its deploy-model run being RUNNING. This worker keeps one *standby* process that has
already imported them (``--preload``) and waits on its stdin. When a flow run arrives, the standby
gets the run's environment and working directory and runs Prefect's engine (``python -m
prefect.engine``) in-process; then the worker starts the next standby.

Each run still gets a process of its own, used once: the same isolation, exit-code, cancellation and
crash handling as Prefect's process worker (it *is* that worker; only the process start differs). A
standby whose preloaded project files changed since it imported them, or whose preload failed,
replaces itself with a cold ``python -m prefect.engine`` (same pid), so a run never executes stale
code. A deployment that sets the ``command`` job variable runs exactly as on the process worker.

    gpuferry worker --pool gpuferry [--name NAME] [--preload flows.deploy_model ...]

The flows run from this gpuferry's own packages (a clone or an installed one; ``--code-dir`` or
``$GPUFERRY_CODE_DIR`` names another checkout), which each flow-run process enters as its working directory.
A deployment whose only pull step enters that directory (prefect.yaml's) has its flow loaded from its entrypoint
at once (``PREFECT__FLOW_ENTRYPOINT``, as Prefect's runner loads the flows it serves), without the deployment
read and the pull step's run, a quarter of a second of the run's start; any other deployment runs its pull steps.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

STANDBY_FLAG = "--standby"
# Everything the project's flows import comes with these (flows.deploy_model imports flows.retrain,
# which imports every block and task); mlflow is imported by the tracking block's first call.
DEFAULT_PRELOAD = ("flows.deploy_model", "flows.sweep", "flows.provision", "mlflow")
# The directory holding this gpuferry's packages (a clone, or site-packages when installed): the flows' entrypoints
# (flows/retrain.py) are relative to it.
INSTALLATION = Path(__file__).resolve().parent.parent


# The names a pull step that only enters a directory goes by (prefect.yaml: set_working_directory).
SET_WORKING_DIRECTORY = (
    "prefect.deployments.steps.set_working_directory",
    "prefect.deployments.steps.pull.set_working_directory",
)


def direct_entrypoint(
    entrypoint: str | None, pull_steps: list[dict[str, Any]] | None, env: dict[str, str], code_dir: Path
) -> str | None:
    """The deployment's ``path.py:flow`` entrypoint when its pull steps do nothing but enter ``code_dir`` (a path, or
    ``{{ $VAR }}`` naming it in the flow-run process's ``env``), so that the run may skip them; else None."""
    if not entrypoint or ":" not in entrypoint or not pull_steps or len(pull_steps) != 1 or len(pull_steps[0]) != 1:
        return None
    ((name, inputs),) = pull_steps[0].items()
    if name not in SET_WORKING_DIRECTORY or not isinstance(inputs, dict) or set(inputs) != {"directory"}:
        return None
    directory = inputs["directory"]
    if not isinstance(directory, str):
        return None
    variable = re.fullmatch(r"\{\{\s*\$(\w+)\s*\}\}", directory.strip())
    if variable:
        directory = env.get(variable.group(1), "")
    if not directory or "{{" in directory:
        return None
    return entrypoint if Path(directory).resolve() == code_dir.resolve() else None


# ---- the standby process ----


def _project_files(root: Path) -> dict[str, float]:
    """The modules loaded from under ``root`` (not from the environment's packages) and their mtimes."""
    environment = Path(sys.prefix).resolve()
    files: dict[str, float] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        resolved = Path(path).resolve()
        if resolved.is_relative_to(root) and not resolved.is_relative_to(environment):
            with contextlib.suppress(OSError):
                files[path] = os.stat(path).st_mtime
    return files


def _stale(files: dict[str, float]) -> bool:
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime != mtime:
                return True
        except OSError:
            return True
    return False


def standby(preload: list[str]) -> None:
    """Import ``preload``, wait for one flow run's order on stdin, run it with Prefect's engine, exit."""
    root = Path.cwd().resolve()
    sys.path.insert(0, str(root))
    failed: BaseException | None = None
    try:
        # Prefect's engine and its own imports, loaded before the order comes (that is the standby's head start).
        import prefect.deployments.steps.core
        import prefect.engine
        import prefect.flow_engine  # noqa: F401 - imported for what it loads

        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - the cold start below reports it in the run's logs
        failed = exc
    files = _project_files(root)
    if failed is None:
        print(
            f"standby process {os.getpid()}: ready ({len(files)} project modules imported)", file=sys.stderr, flush=True
        )

    line = sys.stdin.readline()
    if not line:
        return  # the worker stopped (or retired this standby) before giving it a run
    order = json.loads(line)
    env: dict[str, str] = order["env"]
    os.chdir(order["cwd"])
    if failed is not None or _stale(files):
        why = f"its preload failed ({failed!r})" if failed is not None else "project files changed since its preload"
        print(f"standby process {os.getpid()}: {why}: starting a fresh engine", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "prefect.engine"], env)

    import runpy

    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import Settings

    _reuse_preloaded_scripts(files)

    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0]]
    # Settings read from the environment again, as Prefect's own in-process starter does.
    with SettingsContext(profile=get_settings_context().profile, settings=Settings()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, message=".*found in sys.modules.*")
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


def _reuse_preloaded_scripts(files: dict[str, float]) -> None:
    """Let Prefect's engine take a flow's module from those the standby imported (unchanged: checked above)
    instead of executing its file again: a deployment's entrypoint is a file (``flows/deploy_model.py:deploy_model``),
    which Prefect loads by executing it as a new module, and a flow's definition computes its parameters' JSON
    schema (for the Stack parameter, every block's fields), about a second of the run's start. A file that is no
    preloaded module's is loaded as Prefect loads it."""
    from prefect.utilities import importtools

    preloaded = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path in files:
            preloaded[str(Path(path).resolve())] = module
    load = importtools.load_script_as_module

    def load_script_as_module(path: str) -> Any:
        module = preloaded.get(str(Path(path).resolve()))
        if module is None:
            return load(path)
        print(f"standby process {os.getpid()}: {path}: the module it preloaded", file=sys.stderr, flush=True)
        return module

    importtools.load_script_as_module = load_script_as_module  # import_object looks it up here when called


# ---- the worker ----


def _worker_classes() -> tuple[type, type]:
    import anyio
    from prefect.flows import load_flow_from_flow_run
    from prefect.runner._flow_run_executor import FlowRunExecutorContext
    from prefect.runner._process_manager import ProcessHandle
    from prefect.settings import get_current_settings
    from prefect.utilities.processutils import sanitize_subprocess_env
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

    class Standbys:
        """Keeps one standby process ready; ``take`` hands it out and starts the next a moment later."""

        def __init__(self, preload: list[str], cwd: Path, respawn_delay: float) -> None:
            self.preload = preload
            self.cwd = cwd
            self.respawn_delay = respawn_delay
            self.ready: anyio.abc.Process | None = None

        async def spawn(self) -> anyio.abc.Process:
            argv = [sys.executable, "-m", "deployments.worker", STANDBY_FLAG, *self.preload]
            return await anyio.open_process(
                argv, stdin=subprocess.PIPE, stdout=None, stderr=None, cwd=self.cwd, start_new_session=False
            )

        async def take(self, task_group: anyio.abc.TaskGroup) -> anyio.abc.Process:
            process, self.ready = self.ready, None
            if process is None or process.returncode is not None:
                process = await self.spawn()
            # The next standby's imports would compete for the CPU with this run's start: wait a little.
            task_group.start_soon(self.refill)
            return process

        async def refill(self) -> None:
            await anyio.sleep(self.respawn_delay)
            if self.ready is None or self.ready.returncode is not None:
                self.ready = await self.spawn()

        async def close(self) -> None:
            process, self.ready = self.ready, None
            if process is not None and process.returncode is None:
                process.terminate()
                with anyio.move_on_after(10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()

    class StandbyStarter:
        """A ProcessStarter (as Prefect's EngineCommandStarter) whose process is a standby."""

        def __init__(
            self,
            standbys: Standbys,
            task_group: anyio.abc.TaskGroup,
            cwd: Path,
            env: dict[str, str | None],
            control_channel: Any,
            entrypoint: str | None = None,
        ) -> None:
            self.standbys = standbys
            self.task_group = task_group
            self.cwd = cwd
            self.env = env
            self.control_channel = control_channel
            self.entrypoint = entrypoint

        async def start(self, flow_run: Any, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            control: dict[str, str] = {}
            registered = False
            if self.control_channel is not None:
                try:
                    port, token = self.control_channel.register(flow_run.id)
                    control = {"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token}
                    registered = True
                except RuntimeError:
                    pass  # no loopback listener: cancellation falls back to killing the process
            env: dict[str, str | None] = {**os.environ, **self.env}
            env.update(get_current_settings().to_environment_variables(exclude_unset=True))
            env.update(
                {
                    "PREFECT__FLOW_RUN_ID": str(flow_run.id),
                    "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS": "false",
                    "PREFECT__DEPLOYMENT_NAME": self.env.get("PREFECT__DEPLOYMENT_NAME"),
                    **control,
                }
            )
            if self.entrypoint:
                env["PREFECT__FLOW_ENTRYPOINT"] = self.entrypoint
            order = json.dumps({"env": sanitize_subprocess_env(env), "cwd": str(self.cwd)}) + "\n"
            handed_off = False
            try:
                process = await self.standbys.take(self.task_group)
                async with process:
                    assert process.stdin is not None  # the standby was started with a pipe for its order
                    await process.stdin.send(order.encode())
                    await process.stdin.aclose()
                    handed_off = True
                    task_status.started(ProcessHandle(process))
                    await process.wait()
            except BaseException:
                if registered and not handed_off:
                    self.control_channel.unregister(flow_run.id)
                raise

    class StandbyProcessWorker(ProcessWorker):
        _description = "Process worker whose flow-run processes are started, and their imports done, ahead of the run."

        def __init__(
            self, *args: Any, preload: list[str], code_dir: Path, respawn_delay: float = 3.0, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self._standbys = Standbys(preload, code_dir, respawn_delay)
            self._standby_group: anyio.abc.TaskGroup | None = None

        async def setup(self) -> None:
            await super().setup()
            self._standby_group = anyio.create_task_group()
            await self._standby_group.__aenter__()
            self._standbys.ready = await self._standbys.spawn()
            self._standby_group.start_soon(self._wake_on_scheduled_runs)

        async def _wake_on_scheduled_runs(self) -> None:
            """Ask for runs the moment the server schedules one on this pool (its event stream), not at the next
            poll; polling goes on beside it, so a lost stream costs only the wait for the poll."""
            from prefect.events.clients import get_events_subscriber
            from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter
            from prefect.types._datetime import now

            while True:
                wanted = EventFilter(
                    event=EventNameFilter(name=["prefect.flow-run.Scheduled"]),
                    occurred=EventOccurredFilter(since=now("UTC")),
                )
                try:
                    async with get_events_subscriber(filter=wanted) as events:
                        async for event in events:
                            if any(
                                r.role == "work-pool" and r.get("prefect.resource.name") == self._work_pool_name
                                for r in event.related
                            ):
                                await self.get_and_submit_flow_runs()
                except Exception as exc:  # noqa: BLE001 - the poll still finds every run; try the stream again
                    self._logger.warning("the server's event stream: %s; polling only, for 30 s", exc)
                await anyio.sleep(30)

        async def teardown(self, *exc_info: Any) -> None:
            try:
                if self._standby_group is not None:
                    self._standby_group.cancel_scope.cancel()
                    await self._standby_group.__aexit__(None, None, None)
                await self._standbys.close()
            finally:
                await super().teardown(*exc_info)

        async def run(
            self, flow_run: Any, configuration: ProcessJobConfiguration, task_status: Any = None
        ) -> ProcessWorkerResult:
            if configuration._command_configured or self._standby_group is None:
                return await super().run(flow_run, configuration, task_status)
            if task_status is None:
                task_status = anyio.TASK_STATUS_IGNORED
            entrypoint = None
            if flow_run.deployment_id is not None:
                deployment = await self.client.read_deployment(flow_run.deployment_id)
                process_env = {**os.environ, **{k: v for k, v in configuration.env.items() if v is not None}}
                entrypoint = direct_entrypoint(
                    deployment.entrypoint, deployment.pull_steps, process_env, self._standbys.cwd
                )
            # The run starts where its pull step would have taken it, or (as Prefect's worker) where the steps run.
            working_dir_ctx: contextlib.AbstractContextManager[Any] = (
                contextlib.nullcontext(self._standbys.cwd)
                if entrypoint
                else tempfile.TemporaryDirectory(suffix="prefect")
                if not configuration.working_dir
                else contextlib.nullcontext(configuration.working_dir)
            )
            execution = None
            with working_dir_ctx as working_dir:
                async with FlowRunExecutorContext() as ctx:
                    starter = StandbyStarter(
                        self._standbys,
                        self._standby_group,
                        Path(working_dir).resolve(),
                        configuration.env,
                        ctx.control_channel,
                        entrypoint,
                    )
                    executor = ctx.create_executor(
                        flow_run, starter, resolve_flow=load_flow_from_flow_run, propose_submitting=False
                    )

                    async def execute(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
                        nonlocal execution
                        execution = await executor.submit(task_status=task_status)

                    async with anyio.create_task_group() as group:
                        handle = await group.start(execute)
                        if handle.pid is None:
                            raise RuntimeError("Flow run process has no PID")
                        task_status.started(handle.pid)
            if execution is None or execution.status_code is None:
                raise RuntimeError("Failed to start flow run process.")
            return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))

    return StandbyProcessWorker, Standbys


def _standby_worker_class() -> type:
    with warnings.catch_warnings():
        # It registers under Prefect's "process" type: same pool type and job template.
        warnings.filterwarnings("ignore", message=".*matches existing registered type.*")
        return _worker_classes()[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [STANDBY_FLAG]:
        standby(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True, help="the process work pool to serve (created when missing)")
    parser.add_argument("--name", default=None, help="the worker's name (default: Prefect's)")
    parser.add_argument(
        "--preload",
        nargs="*",
        default=list(DEFAULT_PRELOAD),
        help="modules the standby process imports ahead of a run (default: the project's flows)",
    )
    parser.add_argument(
        "--code-dir",
        default=os.environ.get("GPUFERRY_CODE_DIR") or str(INSTALLATION),
        help="directory the flows are run from (default: $GPUFERRY_CODE_DIR, else this gpuferry's own: "
        f"{INSTALLATION})",
    )
    parser.add_argument("--limit", type=int, default=None, help="most flow runs at once")
    parser.add_argument(
        "--query-seconds",
        type=float,
        default=float(os.environ.get("PREFECT_WORKER_QUERY_SECONDS") or 1.0),
        help="how often it asks the server for runs to start: the most a new run waits for it (default: "
        "$PREFECT_WORKER_QUERY_SECONDS, else 1; Prefect's own default is 10)",
    )
    parser.add_argument(
        "--respawn-delay",
        type=float,
        default=3.0,
        help="seconds after a hand-off before the next standby starts importing",
    )
    args = parser.parse_args(argv)
    if args.query_seconds <= 0:
        parser.error(f"--query-seconds {args.query_seconds:g}: give a number of seconds above 0")
    code_dir = Path(args.code_dir).resolve()
    if not (code_dir / "flows").is_dir():
        parser.error(f"--code-dir {code_dir}: no flows/ in it; give the checkout the flows are loaded from")
    # The deployments' pull step (prefect.yaml: set_working_directory) enters it in each flow-run process.
    os.environ["GPUFERRY_CODE_DIR"] = str(code_dir)

    import anyio

    worker_class = _standby_worker_class()
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings

    async def serve() -> None:
        worker = worker_class(
            work_pool_name=args.pool,
            name=args.name,
            limit=args.limit,
            preload=args.preload,
            code_dir=code_dir,
            respawn_delay=args.respawn_delay,
        )
        await worker.start()

    with temporary_settings({PREFECT_WORKER_QUERY_SECONDS: args.query_seconds}):
        anyio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
