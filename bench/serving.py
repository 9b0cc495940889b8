"""Benchmark P6: our inference server against `mlflow models serve` and LitServe, same MLflow models, same machine.

Two models, the bundled examples' own: each example's training command (its gpuferry.yaml's ``train.command``,
its hyperparameters' defaults) runs as a gpuferry job on this machine (``LocalProcesses``, the embedded stack's
compute backend: the contract's ``CHECKPOINT_DIR``, ``HPARAMS``, ...), and what it wrote to ``final/`` is
served, with a manifest as gpuferry's checkpoint stores write it:

- ``digits`` (examples/digits): the PyTorch MLP (64→128→10, softmax), ``mlflow.pytorch.save_model`` with a 2-row
  input example (one float32 tensor signature);
- ``regressor`` (examples/diabetes): the scikit-learn ElasticNet pipeline, ``mlflow.sklearn.save_model`` with
  DataFrame rows (ten named double columns).

Each is served, one server at a time (they would compete for the same cores), by

- ours: ``python -m runtime.serve`` (one process; predict on one dedicated thread; batching on, defaults);
- ``mlflow models serve -m DIR --env-manager local --workers 1``;
- LitServe (``litserve``) with a ``LitAPI`` that loads the same pyfunc model with ``mlflow.pyfunc.load_model``,
  decodes the same request body, batches (``max_batch_size=64``, ``batch_timeout=0.002``: ours' defaults) and
  predicts through ``PyFuncModel.predict``; one inference worker, one API server, its ZeroMQ fast queue.

Every server gets ``OMP_NUM_THREADS=1`` (one torch/BLAS thread: on 2 cores a second only contends on such tiny
inputs). Before any timing each server's answers to single rows and a multi-row request are checked against the
in-process ``PyFuncModel.predict``. Load: ``wrk`` (a separate process; installed with apt-get if missing),
1-row requests in the model's own serving-input format (``{"inputs": [[...]]}`` and ``{"dataframe_split":
{"columns": [...], "data": [[...]]}}``), concurrency 32, ``BENCH_SECONDS`` (10) per run after a 2-s warm-up, for
``BENCH_ROUNDS`` (3) rounds, the three servers in a rotated order each round. Non-2xx answers and socket errors are
counted. Reported: medians over the rounds, and

    RESULT P6_throughput_ratio_<model>  ours / mlflow requests per second
    RESULT P6_p99_ratio_<model>         ours / mlflow p99 latency
    RESULT P6_vs_litserve_<model>       ours / LitServe requests per second
    RESULT P6_throughput_ratio, P6_p99_ratio, P6_vs_litserve   the worse of the two models
    RESULT P6_errors                    failed requests, all servers and rounds

    .venv/bin/python bench/serving.py                  # about 12 minutes on 2 cores
    BENCH_SECONDS=5 BENCH_ROUNDS=1 .venv/bin/python bench/serving.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import litserve as ls
import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent

SECONDS = int(os.environ.get("BENCH_SECONDS", "10"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CONCURRENCY = 32
MAX_BATCH_SIZE = 64  # ours' default; LitServe gets the same
BATCH_TIMEOUT_S = 0.002  # ours' default MAX_BATCH_WAIT_MS
STARTUP_TIMEOUT = 300.0
SERVERS = ("ours", "mlflow", "litserve")
MODELS = ("digits", "regressor")


@dataclass(frozen=True)
class Run:
    model: str
    server: str
    round: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


# ------------------------------------------------------------------------------------------------ the models


EXAMPLES = {"digits": REPO / "examples" / "digits", "regressor": REPO / "examples" / "diabetes"}
TRAIN_TIMEOUT = 1800.0


def train_example(name: str, workdir: Path) -> Path:
    """Run the example's own training command as a job of the embedded stack's compute backend, with its
    hyperparameters' defaults; the MLflow model it wrote (``final/``), with a manifest."""
    sys.path.insert(0, str(REPO))
    from blocks.base.storage import write_manifest
    from blocks.local.compute import LocalProcesses
    from blocks.plan import plan_run
    from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
    from blocks.workload.source import load_workload

    run = plan_run(load_workload(str(EXAMPLES[name])), TrainingSpec(), ServingSpec(), PromotionPolicy())
    compute = LocalProcesses(workdir_root=str(workdir / "jobs"), python=sys.executable)
    job = run.job(f"bench-{name}", compute.job_workdir(f"bench-{name}"), None, env={})
    handle = compute.submit(job)
    status = compute.watch(handle, timeout_seconds=TRAIN_TIMEOUT)
    result = compute.result(handle, status)  # raises JobFailed with the log's tail
    final = Path(result.checkpoint_dir) / "final"
    write_manifest(final)
    print(
        f"trained {name} ({run.workload.name}, {' '.join(job.command)}) in {status.elapsed_seconds:.0f} s", flush=True
    )
    return final


def save_models(workdir: Path) -> dict[str, tuple[Path, Any, bytes]]:
    """Both examples' MLflow models; per model: directory, verification input, 1-row wrk body."""
    from sklearn.datasets import load_diabetes, load_digits

    digits_dir, regressor_dir = train_example("digits", workdir), train_example("regressor", workdir)
    digits_rows = (load_digits().data[1400:1424] / 16).astype(np.float32)  # the example's scaling: [0, 1]
    frame = load_diabetes(as_frame=True).data.iloc[400:424]
    return {
        "digits": (digits_dir, digits_rows, json.dumps({"inputs": digits_rows[:1].tolist()}).encode()),
        "regressor": (
            regressor_dir,
            frame,
            json.dumps(
                {"dataframe_split": {"columns": list(frame.columns), "data": frame.iloc[:1].to_numpy().tolist()}}
            ).encode(),
        ),
    }


def request_body(model: str, data: Any) -> dict:
    """The model's own serving-input format for ``data``."""
    if model == "digits":
        return {"inputs": data.tolist()}
    return {"dataframe_split": {"columns": list(data.columns), "data": data.to_numpy().tolist()}}


# ---------------------------------------------------------------------------------------- LitServe's side


class PyfuncAPI(ls.LitAPI):
    """LitServe's side: the same pyfunc model, the same request body, LitServe's own batching."""

    def __init__(self, model_dir: str, model: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_dir = model_dir
        self.kind = model

    def setup(self, device: str) -> None:
        import mlflow.pyfunc

        self.model = mlflow.pyfunc.load_model(self.model_dir)

    def decode_request(self, request: dict) -> Any:
        if self.kind == "digits":
            return np.asarray(request["inputs"], dtype=np.float32)
        split = request["dataframe_split"]
        return pd.DataFrame(split["data"], columns=split["columns"])

    def batch(self, inputs: list[Any]) -> Any:
        self.rows = [len(i) for i in inputs]
        return np.concatenate(inputs) if self.kind == "digits" else pd.concat(inputs, ignore_index=True)

    def predict(self, x: Any) -> Any:
        return self.model.predict(x)

    def unbatch(self, output: Any) -> list[Any]:
        bounds = np.cumsum([0, *self.rows])
        return [output[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def encode_response(self, output: Any) -> dict:
        return {"predictions": np.asarray(output).tolist()}


def litserve_main(model_dir: str, model: str, port: int) -> None:
    """LitServe serving the same pyfunc model (run as: bench/serving.py litserve DIR MODEL PORT)."""
    api = PyfuncAPI(
        model_dir, model, max_batch_size=MAX_BATCH_SIZE, batch_timeout=BATCH_TIMEOUT_S, api_path="/invocations"
    )
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, fast_queue=True)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, generate_client_file=False, log_level="warning")


# ----------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(server: str, model_dir: Path, model: str, port: int) -> tuple[list[str], dict[str, str], str]:
    """argv, extra environment and readiness URL of one server."""
    bindir = Path(sys.executable).parent
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    base = f"http://127.0.0.1:{port}"
    if server == "ours":
        env |= {"MODEL_URI": model_dir.as_uri(), "PORT": str(port), "DRAIN_SECONDS": "0"}
        return [sys.executable, "-m", "runtime.serve"], env, f"{base}/readyz"
    if server == "mlflow":
        argv = [
            str(bindir / "mlflow"),
            "models",
            "serve",
            "-m",
            str(model_dir),
            "--env-manager",
            "local",
            "--workers",
            "1",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ]
        return argv, env, f"{base}/ping"
    return (
        [sys.executable, str(Path(__file__).resolve()), "litserve", str(model_dir), model, str(port)],
        env,
        f"{base}/health",
    )


@contextlib.contextmanager
def running(argv: list[str], env: dict[str, str], ready_url: str, log_path: Path) -> Iterator[None]:
    """Run a server in its own process group until the block ends; wait until ``ready_url`` answers 200."""
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv[:3]} exited with {proc.returncode}:\n{_tail(log_path)}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(ready_url, timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ready_url} not ready after {STARTUP_TIMEOUT:.0f} s:\n{_tail(log_path)}")
                time.sleep(0.2)
            yield
        finally:
            stop_group(proc)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (mlflow and LitServe serve from child processes), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ checks and load


def check_answers(url: str, model: str, data: Any, expected: np.ndarray) -> None:
    """Single rows and one multi-row request return the in-process model's predictions (before any timing)."""
    with httpx.Client(timeout=30) as client:
        pieces = [(i, i + 1) for i in range(8)] + [(8, len(data))]
        for a, b in pieces:
            response = client.post(url, json=request_body(model, data[a:b]))
            response.raise_for_status()
            got = np.asarray(response.json()["predictions"])
            if got.shape != expected[a:b].shape or not np.allclose(got, expected[a:b], rtol=1e-5, atol=1e-6):
                raise AssertionError(f"{url}: rows {a}..{b}: got {got.tolist()}, expected {expected[a:b].tolist()}")


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS_MS[unit]


def wrk(url: str, body: bytes, seconds: int, workdir: Path) -> tuple[float, float, float, int]:
    """Run wrk; returns (requests/s, p50 ms, p99 ms, failed requests: non-2xx answers and socket errors)."""
    body_file = workdir / f"body-{abs(hash(body))}.json"
    body_file.write_bytes(body)
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb")\n'
        'wrk.body = f:read("*a")\n'
        "f:close()\n"
    )
    argv = ["wrk", "-t1", f"-c{CONCURRENCY}", f"-d{seconds}s", "--timeout", "10s", "--latency", "-s", str(script), url]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return rps, p50, p99, errors


def ensure_wrk() -> None:
    if shutil.which("wrk"):
        return
    print("installing wrk (apt-get)", flush=True)
    apt = ["apt-get", "install", "-y", "-q", "wrk"]
    if subprocess.run(apt, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        subprocess.run(apt, check=True, capture_output=True)


# ----------------------------------------------------------------------------------------------------- main


def main() -> None:
    ensure_wrk()
    import mlflow.pyfunc

    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    runs: list[Run] = []
    try:
        models = save_models(workdir)
        expected = {
            name: np.asarray(mlflow.pyfunc.load_model(str(d)).predict(data)) for name, (d, data, _) in models.items()
        }
        print(f"models saved in {workdir}; {ROUNDS} rounds, {SECONDS} s per run, concurrency {CONCURRENCY}", flush=True)
        for r in range(ROUNDS):
            order = SERVERS[r % 3 :] + SERVERS[: r % 3]
            for name, (model_dir, data, body) in models.items():
                for server in order:
                    port = free_port()
                    argv, env, ready_url = server_argv(server, model_dir, name, port)
                    with running(argv, env, ready_url, workdir / f"{server}-{name}-{r}.log"):
                        url = f"http://127.0.0.1:{port}/invocations"
                        check_answers(url, name, data, expected[name])
                        wrk(url, body, 2, workdir)  # warm-up, not recorded
                        rps, p50, p99, errors = wrk(url, body, SECONDS, workdir)
                    runs.append(Run(name, server, r, rps, p50, p99, errors))
                    print(
                        f"  round {r + 1} {name:9} {server:8}: {rps:8,.0f} req/s  p50 {p50:7.2f} ms  "
                        f"p99 {p99:7.2f} ms  {errors} errors",
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(runs)


def report(runs: list[Run]) -> None:
    def median(model: str, server: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs if r.model == model and r.server == server)

    print(
        f"\nP6: 1-row requests, concurrency {CONCURRENCY}, wrk -t1, {SECONDS} s per run, medians of {ROUNDS} rounds, "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| model | server | requests/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        for server in SERVERS:
            errors = sum(r.errors for r in runs if r.model == model and r.server == server)
            print(
                f"| {model} | {server} | {median(model, server, 'requests_per_s'):,.0f} "
                f"| {median(model, server, 'p50_ms'):.2f} | {median(model, server, 'p99_ms'):.2f} | {errors} |"
            )
    results: dict[str, dict[str, float]] = {"P6_throughput_ratio": {}, "P6_p99_ratio": {}, "P6_vs_litserve": {}}
    print()
    for model in MODELS:
        ours_rps = median(model, "ours", "requests_per_s")
        results["P6_throughput_ratio"][model] = ours_rps / median(model, "mlflow", "requests_per_s")
        results["P6_p99_ratio"][model] = median(model, "ours", "p99_ms") / median(model, "mlflow", "p99_ms")
        results["P6_vs_litserve"][model] = ours_rps / median(model, "litserve", "requests_per_s")
        for key, values in results.items():
            print(f"RESULT {key}_{model} {values[model]:.3f}")
    worse = {"P6_throughput_ratio": min, "P6_p99_ratio": max, "P6_vs_litserve": min}
    for key, values in results.items():
        print(f"RESULT {key} {worse[key](values.values()):.3f}")
    print(f"RESULT P6_errors {sum(r.errors for r in runs)}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "litserve":
        litserve_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
