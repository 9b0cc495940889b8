"""P4: alias set in MLflow → deploy-model flow run RUNNING, webhook path vs polling path, in one run.

Starts the servers it needs (`make prefect-up mlflow-up`, idempotent). On the shared server it registers
a copy of prefect.yaml's `on-champion` deployment (same flow, trigger and parameters) under a unique
name, on a work pool of its own whose trigger matches an alias of its own, and starts a worker for it
from this checkout — `deployments/worker.py`, as scripts/prefect.sh does (`--worker process`: Prefect's
plain process worker, for comparison). Then a throwaway model with fresh versions and a Stack block
whose tracking is the MLflow server and whose serving is a local directory; one event at a time:

* webhook: MLflow's webhook → deployments/webhook.py (a real receiver process) → Prefect event →
  the deployment's trigger → the worker runs deploy-model;
* polling: the receiver is stopped and deployments/poll_registry.py polls the registry instead.

Each event moves the benchmark's alias to a new version; the benchmark waits for that version's run
to finish before the next one (the deployment runs one deploy at a time). Latency is from just before
the alias call to the run's start time as the server recorded it (RUNNING). Before each event the
standby worker's next process has finished its imports (``standby_wait_s``: how long that took after
the previous run): events reach an idle worker, as registry events minutes apart do. The hops come
from the server too: the event's ``occurred`` (when the receiver or poller emitted it), ``received`` (the events
API), the run's ``created`` (the automation), its PENDING state (the worker took it) and ``start_time``.

    .venv/bin/python bench/event_deploy.py [--events 20] [--poll-events N] [--poll-interval 10]
        [--worker standby|process]

Prints ``RESULT P4_median_s``, ``RESULT P4_p95_s`` (webhook path), ``RESULT P4_poll_median_s`` and
``RESULT P4_poll_p95_s`` (unless ``--poll-events 0``), and the median of every hop. Goal: P4_median_s ≤ 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import private_worker

RUN_DEADLINE_S = 300.0


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    return private_worker.wait_until(what, check, timeout, interval)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Bench:
    def __init__(self, api_url: str, tracking: Any, tmp: Path, worker: str) -> None:
        self.api_url = api_url
        self.tracking = tracking  # the mlflow stack's server and its login (an MlflowTracking block)
        self.tmp = tmp
        uid = uuid.uuid4().hex[:8]
        self.model = f"gpuferry-bench-{uid}"
        self.stack = f"gpuferry-bench-{uid}"
        self.uid = uid
        self.alias = f"p4_{uid}"  # the real on-champion deployment's trigger does not fire for it
        self.pool = f"gpuferry-bench-{uid}"
        self.worker_kind = worker
        self.deployment = ""
        self.serving_dir = tmp / "serving"
        self.env = {
            **os.environ,
            "PREFECT_API_URL": api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        self.env.pop("PREFECT_HOME", None)
        self.next_version = 1
        self.handed_off = 0  # runs the worker has started
        self.procs: list[subprocess.Popen[bytes]] = []

    # ---- setup ----

    def setup(self, versions: int) -> None:
        names = private_worker.render(self.tmp / "prefect.yaml", ["on-champion"], self.pool, self.uid, alias=self.alias)
        self.deployment = names["on-champion"]
        private_worker.deploy(self.tmp / "prefect.yaml", self.env, self.pool)
        worker_env = private_worker.worker_env(self.api_url, self.tmp / "home")
        self.procs.append(
            private_worker.start_worker(
                self.pool, f"bench-{self.uid}", worker_env, self.tmp / "worker.log", kind=self.worker_kind
            )
        )
        from blocks.local.serving import LocalServing
        from blocks.stack import Stack

        stack = Stack.embedded()
        stack.tracking = self.tracking  # the worker and the receiver log in with the saved block's login
        stack.serving = LocalServing(state_dir=str(self.serving_dir), drain_seconds=2)
        stack.save(self.stack, overwrite=True)
        self.register(versions)

    def register(self, count: int) -> None:
        """``count`` versions of one real checkpoint, an MLflow model (each alias move deploys another version)."""
        import mlflow.sklearn
        import numpy as np
        from sklearn.linear_model import LinearRegression

        from blocks.base.storage import write_manifest

        client = self.tracking.client
        experiment = client.create_experiment(self.model, artifact_location=(self.tmp / "artifacts").as_uri())
        client.create_registered_model(self.model)
        run = client.create_run(experiment)
        source = f"{run.info.artifact_uri}/checkpoint"
        path = Path(urlparse(source).path)
        x = np.eye(3)
        mlflow.sklearn.save_model(
            LinearRegression().fit(x, x.sum(axis=1)), str(path), input_example=x[:2], pip_requirements=["scikit-learn"]
        )
        write_manifest(path)  # the server serves only a checkpoint with a manifest
        for _ in range(count):
            client.create_model_version(self.model, source=source, run_id=run.info.run_id)
        client.set_terminated(run.info.run_id)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=env or self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        private_worker.stop(proc, timeout=30)

    # ---- one event ----

    def standby_ready(self) -> float:
        """With the standby worker: wait until a standby process is ready for the next run (it logs
        "ready" once its imports are done; one is started at the worker's start and one after each run
        it was handed). An event arrives at an idle worker, as model-registry events, minutes apart, do.
        Returns the seconds waited."""
        if self.worker_kind != "standby":
            return 0.0
        started = time.monotonic()
        log = self.tmp / "worker.log"

        def ready() -> bool:
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            return sum(1 for line in lines if "standby process" in line and ": ready" in line) > self.handed_off

        wait_for("the worker's next standby process", ready, timeout=RUN_DEADLINE_S, interval=0.2)
        return time.monotonic() - started

    def set_alias_and_time(self, timeout: float = RUN_DEADLINE_S) -> dict[str, float]:
        """Move the alias to the next version; wait for its run to finish; return the hops (seconds)."""
        standby_wait_s = self.standby_ready()
        version = str(self.next_version)
        self.next_version += 1
        client = self.tracking.client
        set_at = datetime.now(UTC)
        client.set_registered_model_alias(self.model, self.alias, version)
        returned_s = (datetime.now(UTC) - set_at).total_seconds()

        run = wait_for(
            f"the deploy-model run for v{version}", lambda: self.run_for(version, started=True), timeout=timeout
        )
        self.handed_off += 1
        final = wait_for(f"the v{version} run to finish", lambda: self.finished(run.id), timeout=timeout, interval=0.5)
        if not final.state.is_completed():
            raise SystemExit(f"the v{version} run ended {final.state.type}: {final.state.message} (logs: {self.tmp})")
        event = self.event_for(version, set_at)
        hops = {
            "standby_wait_s": standby_wait_s,
            "alias_call_s": returned_s,
            "running_s": (run.start_time - set_at).total_seconds(),
            "created_s": (run.created - set_at).total_seconds(),
        }
        pending = self.pending_at(run.id)
        if pending is not None:
            hops["pending_s"] = (pending - set_at).total_seconds()
        if event is not None:
            hops["emitted_s"] = (event.occurred - set_at).total_seconds()
            hops["event_received_s"] = (event.received - set_at).total_seconds()
        return hops

    def run_for(self, version: str, started: bool = False) -> Any:
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        from prefect.client.schemas.sorting import FlowRunSort

        with SyncPrefectClient(self.api_url) as client:
            dep = client.read_deployment_by_name(self.deployment)
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                limit=50,
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            )
        mine = [
            r
            for r in runs
            if r.parameters.get("model_name") == self.model and str(r.parameters.get("version")) == version
        ]
        if len(mine) > 1:
            raise SystemExit(f"{len(mine)} deploy-model runs for v{version}: one event, one run expected")
        if not mine or (started and mine[0].start_time is None):
            return None
        return mine[0]

    def pending_at(self, run_id: Any) -> datetime | None:
        """When the worker took the run (its PENDING state, as the server recorded it)."""
        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(self.api_url) as client:
            states = client.read_flow_run_states(run_id)
        return min((s.timestamp for s in states if s.type.value == "PENDING"), default=None)

    def finished(self, run_id: Any) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(self.api_url) as client:
            run = client.read_flow_run(run_id)
        return run if run.state and run.state.is_final() else None

    def event_for(self, version: str, since: datetime) -> Any:
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

        from deployments import mlflow_events

        flt = EventFilter(
            occurred=EventOccurredFilter(since=since - timedelta(seconds=5)),
            event=EventNameFilter(name=[mlflow_events.ALIAS_SET]),
            resource=EventResourceFilter(id=[mlflow_events.resource_id(self.model, version)]),
        )
        with SyncPrefectClient(self.api_url) as client:
            events = client.read_events(filter=flt, limit=5).events
        return min(events, key=lambda e: e.occurred) if events else None

    # ---- the two paths ----

    def webhook_path(self, n: int) -> list[dict[str, float]]:
        import httpx

        from blocks.base.proc import free_port

        secret = uuid.uuid4().hex + uuid.uuid4().hex
        port = free_port("127.0.0.1")
        receiver = self.start(
            "receiver",
            [
                sys.executable,
                "-m",
                "deployments.webhook",
                "--port",
                str(port),
                "--stack",
                self.stack,
                "--register",
                "--webhook-name",
                self.stack,
                "--model",
                self.model,
            ],
            env={**self.env, "GPUFERRY_WEBHOOK_SECRET": secret},
        )

        def up() -> bool:
            if receiver.poll() is not None:
                raise SystemExit(f"the receiver exited: {(self.tmp / 'receiver.log').read_text()[-2000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("the webhook receiver", up, timeout=120, interval=0.5)
        # MLflow caches the list of webhooks per event for MLFLOW_WEBHOOK_CACHE_TTL (scripts/mlflow.sh: 5 s):
        # an alias set before that cache expires is not delivered to a webhook created just now (nor later).
        # Warm-up events, not counted, until one is delivered.
        warm = time.monotonic()
        while True:
            version = str(self.next_version)
            self.next_version += 1
            self.tracking.client.set_registered_model_alias(self.model, self.alias, version)
            try:
                wait_for(
                    "a delivery",
                    lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["emitted"],
                    timeout=10,
                    interval=0.5,
                )
                break
            except SystemExit:
                if time.monotonic() - warm > 300:
                    raise SystemExit("MLflow delivered no webhook in 300 s (is the webhook enabled?)") from None
        run = wait_for(f"the warm-up run for v{version}", lambda: self.run_for(version), timeout=RUN_DEADLINE_S)
        self.handed_off += 1
        wait_for("the warm-up run to finish", lambda: self.finished(run.id), timeout=RUN_DEADLINE_S, interval=0.5)
        print(f"  webhook: first delivery {time.monotonic() - warm:.1f} s after registering (MLflow's webhook cache)")
        results = []
        for i in range(n):
            hops = self.set_alias_and_time()
            results.append(hops)
            print(f"  webhook {i + 1}/{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in hops.items()), flush=True)
        self.stop(receiver)
        from deployments.webhook import unregister_webhook

        unregister_webhook(self.tracking, self.stack)
        return results

    def poll_path(self, n: int, interval: float) -> list[dict[str, float]]:
        state = self.tmp / "poll-state.json"
        poller = self.start(
            "poller",
            [
                sys.executable,
                "-m",
                "deployments.poll_registry",
                "--stack",
                self.stack,
                "--interval",
                str(interval),
                "--model",
                self.model,
                "--alias",
                self.alias,
                "--state-file",
                str(state),
            ],
        )
        wait_for("the poller's first poll", lambda: poller.poll() is None and state.exists(), timeout=120, interval=0.5)
        results = []
        for i in range(n):
            hops = self.set_alias_and_time()
            results.append(hops)
            print(f"  poll {i + 1}/{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in hops.items()), flush=True)
        self.stop(poller)
        return results

    def cleanup(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        try:
            from blocks.local.serving import LocalServing
            from deployments.webhook import unregister_webhook

            unregister_webhook(self.tracking, self.stack)
            LocalServing(state_dir=str(self.serving_dir)).undeploy(self.model)  # no service recorded: the model's name
            self.tracking.client.delete_registered_model(self.model)
            from prefect.client.orchestration import SyncPrefectClient

            if self.deployment:
                private_worker.remove(self.api_url, [self.deployment], self.pool)
            with SyncPrefectClient(self.api_url) as client:
                from blocks.stack import Stack

                document = client.read_block_document_by_name(self.stack, Stack.get_block_type_slug())
                client.delete_block_document(document.id)
        except Exception as exc:  # noqa: BLE001 - best effort
            print(f"cleanup: {exc}")


def summary(name: str, results: list[dict[str, float]]) -> None:
    for hop in results[0]:
        values = [r[hop] for r in results if hop in r]
        print(
            f"  {name} {hop}: median {statistics.median(values):.2f} s, p95 {percentile(values, 95):.2f} s, "
            f"max {max(values):.2f} s"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20, help="alias changes per path")
    parser.add_argument(
        "--poll-events",
        type=int,
        default=None,
        help="alias changes on the polling path (default: --events; 0: skip it)",
    )
    parser.add_argument("--poll-interval", type=float, default=10.0, help="the poller's interval (its default: 10)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    parser.add_argument(
        "--worker",
        choices=["standby", "process"],
        default="standby",
        help="standby: deployments/worker.py (the stack's worker); process: Prefect's process worker",
    )
    args = parser.parse_args()

    subprocess.run(["make", "-s", "prefect-up", "mlflow-up"], cwd=REPO, check=True)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.stacks import mlflow_server, stack_env

    api_url = stack_env("prefect")["PREFECT_API_URL"]
    tracking = mlflow_server()
    tmp = Path(tempfile.mkdtemp(prefix="gpuferry-p4-"))
    with temporary_settings({PREFECT_API_URL: api_url}):
        bench = Bench(api_url, tracking, tmp, args.worker)
        try:
            bench.setup(versions=2 * args.events + 40)
            print(f"worker: {args.worker}; load: {os.getloadavg()[0]:.1f}", flush=True)
            print(f"webhook path: {args.events} alias changes", flush=True)
            webhook = bench.webhook_path(args.events)
            polled = args.events if args.poll_events is None else args.poll_events
            poll = []
            if polled:
                print(f"polling path: {polled} alias changes, poll every {args.poll_interval:g} s", flush=True)
                poll = bench.poll_path(polled, args.poll_interval)
        finally:
            bench.cleanup()
            if args.keep:
                print(f"kept {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    summary("webhook", webhook)
    running = [r["running_s"] for r in webhook]
    print(f"RESULT P4_median_s {statistics.median(running):.2f}")
    print(f"RESULT P4_p95_s {percentile(running, 95):.2f}")
    if poll:
        summary("poll", poll)
        poll_running = [r["running_s"] for r in poll]
        print(f"RESULT P4_poll_median_s {statistics.median(poll_running):.2f}")
        print(f"RESULT P4_poll_p95_s {percentile(poll_running, 95):.2f}")
    for hop in ("emitted_s", "event_received_s", "created_s", "pending_s"):
        values = [r[hop] for r in webhook if hop in r]
        if values:
            print(f"RESULT P4_webhook_{hop.removesuffix('_s')}_median_s {statistics.median(values):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
