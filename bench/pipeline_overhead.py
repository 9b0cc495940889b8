"""P5: orchestration overhead of the embedded retrain pipeline.

Runs ``retrain`` of each bundled example on the embedded stack against a running Prefect server (started
once, as in production, and not counted), and times every call into a block: that is the steps' own work
(loading the workload, training, checkpoint copy, server start, MLflow, provisioning). The rest of the
flow's wall time is orchestration overhead: Prefect's flow and task runs, state changes, logs and
artifacts, and our glue.

    .venv/bin/python bench/pipeline_overhead.py [--runs 3] [--workload examples/digits ...]

Prints a line per run, ``RESULT P5_<workload> <median overhead %>`` for each workload and ``RESULT P5``
(the largest of them). Goal: ≤ 10 % for each.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Block methods that do a step's work, grouped as the report shows them.
WORK = {
    "training": [("blocks.compute", "LocalProcesses", "submit"), ("blocks.compute", "ComputeBackend", "watch")],
    "checkpoint copy": [
        ("blocks.compute", "ComputeBackend", "store_model"),
        ("blocks.storage", "LocalCheckpointStore", "put"),
    ],
    "server start": [("blocks.serving", "LocalServing", "deploy"), ("blocks.serving", "LocalServing", "preflight")],
    "mlflow": [
        ("blocks.tracking", "MlflowTracking", name)
        for name in (
            "start_run",
            "log",
            "run_metrics",
            "end_run",
            "register",
            "version_by_alias",
            "version_metric",
            "set_alias",
            "tag_version",
            "record_deploy",
            "run_url",
        )
    ],
    "provisioning": [
        ("blocks.provision", "LocalMachine", "acquire"),
        ("blocks.provision", "NodeProvider", "check"),
        ("blocks.provision", "LocalMachine", "release"),
    ],
    "image": [("blocks.images", "CurrentEnvironment", "build")],
    # Module functions are timed where the tasks call them.
    "workload": [
        ("tasks.workload", None, "load_workload"),
        ("blocks.compute", "ComputeBackend", "inspect_model"),
        ("blocks.storage", "CheckpointStore", "read_file"),
    ],
}
# Hyperparameters of each run, per example: each run deploys a better or worse model alike.
RUNS = {"digits": [{"seed": i} for i in range(10)], "diabetes": [{"alpha": 0.01 * (i + 1)} for i in range(10)]}

_timings: dict[str, float] = defaultdict(float)
_depth = threading.local()


def _timed(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_depth, "n", 0) == 0  # count nested block calls once
        _depth.n = getattr(_depth, "n", 0) + 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1
            if outer:
                _timings[category] += time.perf_counter() - start

    return wrapper


def instrument() -> None:
    import importlib

    for category, targets in WORK.items():
        for module, cls_name, method in targets:
            owner = importlib.import_module(module)
            if cls_name is None:
                setattr(owner, method, _timed(category, getattr(owner, method)))
                continue
            cls = getattr(owner, cls_name)
            setattr(cls, method, _timed(category, cls.__dict__[method]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workload", action="append", help="a workload directory (default: both examples)")
    args = parser.parse_args()
    workloads = args.workload or [str(ROOT / "examples" / "digits"), str(ROOT / "examples" / "diabetes")]

    home = tempfile.mkdtemp(prefix="gpuferry-bench-")
    os.environ["GPUFERRY_HOME"] = home
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    instrument()

    from prefect.testing.utilities import prefect_test_harness

    from blocks.specs import TrainingSpec
    from blocks.stack import Stack
    from blocks.workload.source import load_workload
    from flows.retrain import retrain

    medians = {}
    with prefect_test_harness(server_startup_timeout=180):
        for workload in workloads:
            name = Path(workload).name
            overheads = []
            for i in range(args.runs):
                _timings.clear()
                spec = TrainingSpec(model_name=f"bench-overhead-{name}", hyperparameters=RUNS.get(name, [{}] * 10)[i])
                start = time.perf_counter()
                retrain(workload=workload, training=spec, force_deploy=True)
                wall = time.perf_counter() - start
                work = sum(_timings.values())
                overhead = 100 * (wall - work) / wall
                overheads.append(overhead)
                parts = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(_timings.items(), key=lambda kv: -kv[1]))
                print(
                    f"{name} run {i + 1}: wall {wall:.2f}s, steps' own work {work:.2f}s ({parts}), "
                    f"overhead {overhead:.1f} %"
                )
            Stack.embedded().serving.undeploy(load_workload(workload).definition.service_name)
            medians[name] = statistics.median(overheads)
            print(f"RESULT P5_{name} {medians[name]:.2f}")
    print(f"RESULT P5 {max(medians.values()):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
