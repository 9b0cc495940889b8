"""Benchmark P6: workload/serve.py against `mlflow models serve`, same model, same machine.

Trains the digits MLP, saves it in the checkpoint layout (``final/model.pt``) and logs the same weights with
``mlflow.pytorch.log_model`` into a throwaway SQLite tracking store. Then, one server at a time (they would
compete for the same cores): start it, check its answers against the in-process model, and load it with wrk
(a separate process) for 1- and 32-sample requests at concurrency 1, 8 and 32.

    .venv/bin/python bench/serving.py              # ~20 s per point, about 5 minutes in all
    BENCH_SECONDS=5 .venv/bin/python bench/serving.py

Prints the table and ``RESULT P6_throughput_ratio`` (ours/mlflow samples per second) and ``RESULT P6_p99_ratio``
(ours/mlflow p99 latency), both at 1-sample requests and concurrency 32. Needs ``wrk``
(``apt-get install -y wrk``). Our server runs with its default settings; ``mlflow models serve`` with
``--env-manager local --workers 1``, its defaults otherwise, and ``OMP_NUM_THREADS=1`` (one torch thread, as our
server picks on a 2-core machine: a second thread only contends on such tiny tensors).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from blocks.storage import write_manifest  # noqa: E402
from runtime import contract  # noqa: E402
from workload.data import load_digits_split  # noqa: E402
from workload.model import build_model  # noqa: E402

SECONDS = int(os.environ.get("BENCH_SECONDS", "20"))
SAMPLES_PER_REQUEST = (1, 32)
CONCURRENCY = (1, 8, 32)
STARTUP_TIMEOUT = 180.0


@dataclass(frozen=True)
class Point:
    server: str
    samples: int
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def samples_per_s(self) -> float:
        return self.requests_per_s * self.samples


# ------------------------------------------------------------------------------------------------ the model


def train(seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """The digits MLP (64→128→10), trained full-batch in well under a second; returns the model and its config."""
    torch.manual_seed(seed)
    config = {"hidden": 128}
    model = build_model(config)
    x, y = (torch.from_numpy(a) for a in load_digits_split()["train"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), config


def log_to_mlflow(model: torch.nn.Module, example: np.ndarray, workdir: Path) -> tuple[str, dict[str, str]]:
    """Log the model into a fresh SQLite tracking store; returns the model URI and the env that resolves it."""
    import mlflow
    import mlflow.pytorch

    # `mlflow models serve` runs `uvicorn` from PATH: put this interpreter's scripts first.
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # The same single torch thread our server picks on this machine (see the module docstring).
        "OMP_NUM_THREADS": "1",
    }
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    experiment = mlflow.create_experiment("bench-serving", artifact_location=(workdir / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        # A 2-row example: torch.export keeps a batch dimension of 1 static, and the served model would then
        # accept only single rows.
        mlflow.pytorch.log_model(model, name="model", input_example=example[:2])
    return f"runs:/{run.info.run_id}/model", env


# ----------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(argv: list[str], env: dict[str, str], ready_url: str, log_path: Path) -> Iterator[None]:
    """Run a server in its own process group until the block ends; wait until ``ready_url`` answers 200."""
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv[0]} exited with {proc.returncode}:\n{_tail(log_path)}")
                try:
                    if httpx.get(ready_url, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ready_url} not ready after {STARTUP_TIMEOUT:.0f} s:\n{_tail(log_path)}")
                time.sleep(0.2)
            yield
        finally:
            stop_group(proc)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (mlflow serves from a child process), SIGKILL after 30 s."""
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


def check_answers(url: str, x: np.ndarray, reference: np.ndarray, to_labels: Callable[[dict], list[int]]) -> None:
    """Both request sizes return the in-process model's predictions (checked before any timing)."""
    with httpx.Client(timeout=30) as client:
        for samples in SAMPLES_PER_REQUEST:
            for start in range(0, len(x), samples):
                rows = x[start : start + samples]
                response = client.post(url, json={"inputs": rows.tolist()})
                response.raise_for_status()
                labels = to_labels(response.json())
                expected = reference[start : start + samples].tolist()
                if labels != expected:
                    raise AssertionError(f"{url}: rows {start}..: got {labels}, expected {expected}")


def ours_labels(body: dict) -> list[int]:
    return body["predictions"]


def mlflow_labels(body: dict) -> list[int]:
    # The pyfunc flavour returns the module's raw outputs (logits), one list per row.
    return np.asarray(body["predictions"]).argmax(axis=1).tolist()


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS_MS[unit]


def wrk(url: str, body: bytes, concurrency: int, seconds: int, workdir: Path) -> tuple[float, float, float, int]:
    """Run wrk; returns (requests/s, p50 ms, p99 ms, failed requests)."""
    body_file = workdir / f"body-{len(body)}.json"
    body_file.write_bytes(body)
    script = workdir / f"post-{len(body)}.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb")\n'
        'wrk.body = f:read("*a")\n'
        "f:close()\n"
    )
    argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "10s", "--latency", "-s", str(script), url]
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


def measure(server: str, url: str, x: np.ndarray, workdir: Path) -> list[Point]:
    points = []
    bodies = {n: json.dumps({"inputs": x[:n].tolist()}).encode() for n in SAMPLES_PER_REQUEST}
    wrk(url, bodies[1], 8, 2, workdir)  # warm-up, not recorded
    for samples in SAMPLES_PER_REQUEST:
        for concurrency in CONCURRENCY:
            rps, p50, p99, errors = wrk(url, bodies[samples], concurrency, SECONDS, workdir)
            points.append(Point(server, samples, concurrency, rps, p50, p99, errors))
            print(
                f"  {server}: {samples} samples/request, concurrency {concurrency}: {rps:,.0f} req/s, "
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, {errors} errors",
                flush=True,
            )
    return points


# ----------------------------------------------------------------------------------------------------- main


def main() -> None:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    torch.set_num_threads(1)  # tiny tensors: more threads only contend (10x slower on a busy 2-core machine)
    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    try:
        model, config = train()
        x_test, y_test = load_digits_split()["test"]
        x = x_test[:96]
        with torch.inference_mode():
            reference = model(torch.from_numpy(x)).argmax(dim=1).numpy()
            accuracy = (model(torch.from_numpy(x_test)).argmax(dim=1).numpy() == y_test).mean()
        print(f"model: {config}, test accuracy {accuracy:.3f}; workdir {workdir}", flush=True)

        checkpoint = workdir / contract.FINAL_DIRNAME
        checkpoint.mkdir()
        torch.save({"state_dict": model.state_dict(), "config": config}, checkpoint / contract.MODEL_FILENAME)
        write_manifest(checkpoint)  # the server serves only a checkpoint with a manifest
        mlflow_uri, mlflow_env = log_to_mlflow(model, x, workdir)

        points: list[Point] = []
        port = free_port()
        mlflow_bin = str(Path(sys.executable).parent / "mlflow")
        argv = [mlflow_bin, "models", "serve", "-m", mlflow_uri, "--env-manager", "local", "--workers", "1",
                "-p", str(port), "-h", "127.0.0.1"]  # fmt: skip
        print(f"mlflow models serve -m {mlflow_uri} ...", flush=True)
        with running(argv, mlflow_env, f"http://127.0.0.1:{port}/ping", workdir / "mlflow-serve.log"):
            url = f"http://127.0.0.1:{port}/invocations"
            check_answers(url, x, reference, mlflow_labels)
            points += measure("mlflow models serve", url, x, workdir)

        port = free_port()
        env = {contract.MODEL_URI: checkpoint.as_uri(), contract.PORT: str(port), "DRAIN_SECONDS": "0"}
        print(f"workload/serve.py MODEL_URI={checkpoint.as_uri()} ...", flush=True)
        argv = [sys.executable, str(REPO / "workload" / "serve.py")]
        with running(argv, env, f"http://127.0.0.1:{port}/readyz", workdir / "serve.log"):
            url = f"http://127.0.0.1:{port}/predict"
            check_answers(url, x, reference, ours_labels)
            points += measure("workload/serve.py", url, x, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\nP6: {SECONDS} s per point, wrk -t1, {os.cpu_count()} CPUs\n")
    print("| server | samples/request | concurrency | requests/s | samples/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for p in points:
        print(
            f"| {p.server} | {p.samples} | {p.concurrency} | {p.requests_per_s:,.0f} | {p.samples_per_s:,.0f} "
            f"| {p.p50_ms:.2f} | {p.p99_ms:.2f} | {p.errors} |"
        )
    key = {(p.server, p.samples, p.concurrency): p for p in points}
    ours, theirs = key[("workload/serve.py", 1, 32)], key[("mlflow models serve", 1, 32)]
    print(f"\nRESULT P6_throughput_ratio {ours.samples_per_s / theirs.samples_per_s:.2f}")
    print(f"RESULT P6_p99_ratio {ours.p99_ms / theirs.p99_ms:.3f}")


if __name__ == "__main__":
    main()
