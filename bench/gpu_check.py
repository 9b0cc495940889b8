"""GPU check: the digits example trained on a GPU under the job contract, then models served on the GPU and the CPU.

On a machine with an NVIDIA GPU (without one, or with ``--cpu-only``, it runs the CPU half):

1. examples/digits/train.py as it is, under gpuferry's job contract (``CHECKPOINT_DIR``, ``HPARAMS``,
   ``PROGRESS_FILE``, ``CHECKPOINT_EVERY``): SIGTERM once its first epoch is done (exit 75 and a ``step-*``
   checkpoint expected), then started again (it must resume, exit 0 and write ``final/``). The same under
   torchrun, 2 processes on the one GPU (a small launcher gives both ``LOCAL_RANK=0``: train.py takes
   ``cuda:LOCAL_RANK``): NCCL first (it refuses two ranks on one device: expected to fail), then gloo on the
   GPU, then gloo on the CPU; the first that trains is ``G0_torchrun_backend``. No MLflow server:
   ``MLFLOW_TRACKING_URI`` is unset, so train.py logs nothing but still saves the model.
2. That model (saved from the CPU with ``torch.export``, MLflow's default: issue 29's case) served by
   ``python -m runtime.serve`` with ``MODEL_DEVICE=cuda``, then ``MODEL_DEVICE=cpu CUDA_VISIBLE_DEVICES=""``,
   one server at a time: each must become ready, say its device (``/readyz``, ``/version``'s
   ``X-Model-Device``) and answer the model's serving input example, single rows and 512 rows as the other
   does (within 1e-4). Load: 1-row requests at concurrency 32; 512-row requests at concurrency 8. The GPU
   server's memory is reported where nvidia-smi lists processes.
3. A model whose forward pass dominates: a transformer encoder with random weights (nothing downloaded), 8
   layers of width 512 over 128 token ids: ~6.7 GFLOP a row for ~0.5 KB of JSON (an image model's 150,528
   floats a row would make JSON parsing the bottleneck). Saved with a 2-row input example (a dynamic batch
   dimension), served on the GPU and the CPU with the dynamic batcher on, compared (within 1e-3), loaded with
   1-row requests at concurrency 64 (the slow CPU side for 60% of the seconds).

Load: client processes (one per two cores, at most 8), threads on keep-alive loopback connections, raw
HTTP/1.1, closed loop, a second of warm-up, bounded in time and requests. Any non-200 answer or socket error
fails the check, as do a server not ready on cuda, a wrong device, GPU and CPU answers that differ, a job that
did not stop with a checkpoint or resume (exit code 1). Printed: ``CHECK ok|FAILED ...`` and

    RESULT G0_train_device cuda, G0_torchrun_backend nccl|gloo-cuda|gloo-cpu, G0_test_accuracy, G0_train_s
    RESULT G0_{gpu,cpu}_ready_s; G0_digits_{gpu,cpu}_rps, ..._p50_ms, ..._p99_ms (1 row, concurrency 32);
           G0_digits_{gpu,cpu}_512_rows_per_s, ..._512_p99_ms; G0_gpu_server_mib (n/a unless nvidia-smi says)
    RESULT G1_{gpu,cpu}_rps, G1_{gpu,cpu}_p99_ms; G1_gpu_vs_cpu <x> (GPU/CPU requests/s, goal >= 5; n/a
           without a GPU); G1_p99_ms (GPU); G_errors; G_total_s

Bring to a GPU machine with Python 3.12, torch, numpy, pandas, scikit-learn, uvloop, httpx and pyyaml but no
registry: this repository and CPython 3.12 manylinux x86_64 wheels of what runtime/requirements.txt names that
it lacks (mlflow-skinny and its missing dependencies, uvicorn, httptools, orjson, boto3...: the wheel folder's
README lists them). From the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site WHEELS/*.whl
    PYTHONPATH=/tmp/site python3 bench/gpu_check.py        # about 5 minutes on an H200 with 16 cores
    python3 bench/gpu_check.py --cpu-only --quick           # the CPU half, small sizes (2 cores: ~2.5 minutes)

``--skip train|digits|heavy`` leaves a part out, ``--seconds`` is each load phase (12; 3 with ``--quick``),
``--workdir`` keeps what it wrote. It imports nothing of gpuferry but runtime/ (the server runs as ``python -m
runtime.serve``, the repository root on ``PYTHONPATH``) and the example's data.py.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DIGITS = REPO / "examples" / "digits"
STARTUP_S = 300.0
FAILURES: list[str] = []
ERRORS = [0]  # failed requests, all load phases


def result(name: str, value: Any) -> None:
    print(f"RESULT {name} {f'{value:.4g}' if isinstance(value, float) else value}", flush=True)


def check(ok: bool, what: str, detail: str = "") -> bool:
    print(f"CHECK {'ok' if ok else 'FAILED'} {what}{'' if ok or not detail else ': ' + detail}", flush=True)
    if not ok:
        FAILURES.append(what)
    return ok


def phase(title: str) -> None:
    print(f"\n=== {title} [{time.strftime('%H:%M:%S')}]", flush=True)


def child_env(work: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")  # every process imports torch and MLflow: cache the bytecode
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def start(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# ---------------------------------------------------------------------------------------------------- training

LAUNCHER = """import os, runpy, sys
import torch.distributed as dist
backend = os.environ.get("GPU_CHECK_BACKEND")
if backend:  # the backend asked for, whatever train.py would choose
    real = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: real(backend, **kwargs)
if os.environ.get("GPU_CHECK_ONE_GPU"):  # every rank on cuda:0: train.py takes cuda:LOCAL_RANK
    os.environ["LOCAL_RANK"] = "0"
sys.path.insert(0, {digits!r})
sys.argv = ["train.py"]
runpy.run_path({train!r}, run_name="__main__")
"""


def run_job(
    cmd: list[str], env: dict[str, str], ckpt: Path, log: Path, timeout_s: float, preempt: bool
) -> tuple[int, str]:
    """Run the job to its end, or with ``preempt`` SIGTERM it (the launcher, as a scheduler does) once its
    progress file says its first epoch is done: (exit code, log)."""
    progress = ckpt.parent / f"{ckpt.name}-progress.json"
    if preempt:  # a fresh job (a kept --workdir may hold an earlier one)
        shutil.rmtree(ckpt, ignore_errors=True)
    proc = start(cmd, {**env, "CHECKPOINT_DIR": str(ckpt), "PROGRESS_FILE": str(progress)}, log, cwd=DIGITS)
    deadline = time.monotonic() + timeout_s
    while preempt and proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] > 0:
                proc.send_signal(signal.SIGTERM)
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    try:
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    return stop(proc), log.read_text(errors="replace")


def train(work: Path, gpu: bool, quick: bool) -> Path | None:
    phase("training examples/digits under the job contract")
    epochs = 60 if quick else 200  # ~20 steps an epoch: long enough to be stopped after its first
    env = child_env(
        work,
        HPARAMS=json.dumps({"epochs": epochs}),
        CHECKPOINT_EVERY="50",
        **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}),
    )
    started = time.monotonic()
    ckpt, cmd = work / "ckpt-one-process", [sys.executable, "train.py"]
    code, text = run_job(cmd, env, ckpt, work / "train-1.log", 240, preempt=True)
    stopped = code == 75 and "preempted: saved checkpoint" in text and any(ckpt.glob("step-*"))
    final = None
    if check(stopped, "one process: SIGTERM mid-run → exit 75 with a checkpoint", f"exit {code}\n{text[-3000:]}"):
        device = "cuda" if "device cuda" in text else "cpu" if "device cpu" in text else "unknown"
        result("G0_train_device", device)
        want = "cuda" if gpu else "cpu"
        check(device == want, f"train.py trains on {want}", f"it said {device}")
        code, text = run_job(cmd, env, ckpt, work / "train-2.log", 240, preempt=False)
        if check(
            code == 0 and "resumed from step-" in text and (ckpt / "final" / "MLmodel").is_file(),
            "one process: resumed to the end, final/ written",
            f"exit {code}\n{text[-3000:]}",
        ):
            final = ckpt / "final"
            progress = json.loads((work / "ckpt-one-process-progress.json").read_text())
            result("G0_test_accuracy", float(progress["metrics"]["test_accuracy"]))
    result("G0_train_s", time.monotonic() - started)

    launcher = work / "launch_train.py"
    launcher.write_text(LAUNCHER.format(digits=str(DIGITS), train=str(DIGITS / "train.py")))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher)]
    one_gpu = {"GPU_CHECK_ONE_GPU": "1"}
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): it has a minute to say so.
    attempts = (
        [
            ("nccl", 60, {"GPU_CHECK_BACKEND": "nccl", **one_gpu}),
            ("gloo-cuda", 120, {"GPU_CHECK_BACKEND": "gloo", **one_gpu}),
        ]
        if gpu
        else []
    )
    attempts.append(("gloo-cpu", 120, {"GPU_CHECK_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}))
    for backend, timeout_s, extra in attempts:
        env2 = {**env, **extra, "HPARAMS": json.dumps({"epochs": epochs // 2})}
        ckpt = work / f"ckpt-torchrun-{backend}"
        code, text = run_job(torchrun, env2, ckpt, work / f"train-torchrun-{backend}-1.log", timeout_s, preempt=True)
        if "preempted: saved checkpoint" not in text:
            errors = [line for line in text.splitlines() if "Error" in line][-3:] or text.splitlines()[-5:]
            print(f"torchrun with {backend}: did not train (exit {code}):", *errors, sep="\n  ", flush=True)
            continue
        result("G0_torchrun_backend", backend)
        marked = code != 0 and (ckpt / "PREEMPTED").exists()
        check(marked, f"torchrun ({backend}): preempted, marker left", f"exit {code}")
        code, text = run_job(torchrun, env2, ckpt, work / f"train-torchrun-{backend}-2.log", 240, preempt=False)
        ok = code == 0 and "resumed from step-" in text and "world size 2" in text
        ok = ok and (ckpt / "final" / "MLmodel").is_file()
        check(ok, f"torchrun ({backend}): resumed to the end, final/ written", f"exit {code}\n{text[-3000:]}")
        break
    else:
        check(False, "torchrun: 2 processes train with one of " + ", ".join(b for b, _, _ in attempts))
    return final


def plain_digits_model(work: Path) -> Path:
    """The digits job run to its end on the CPU (a few epochs): the model to serve when training is skipped."""
    ckpt = work / "ckpt-plain"
    shutil.rmtree(ckpt, ignore_errors=True)
    env = child_env(work, HPARAMS=json.dumps({"epochs": 5}), CHECKPOINT_DIR=str(ckpt), CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "train.py"], cwd=DIGITS, env=env, check=True, capture_output=True, timeout=600)
    return ckpt / "final"


# ------------------------------------------------------------------------------------------------- the servers


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc, self.port = proc, port

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nvidia_smi(*args: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_mib(pid: int) -> float | None:
    """The GPU memory nvidia-smi says process ``pid`` holds; None where it does not list it."""
    out = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    return next(
        (float(m) for p, _, m in (line.partition(",") for line in out.splitlines()) if p.strip() == str(pid)), None
    )


def serve(model_dir: Path, device: str, work: Path, tag: str, gpu: bool) -> Served | None:
    """runtime.serve on ``device``, once /readyz says 200 and the device checks ran; None when it never got there."""
    port, key = free_port(), "gpu" if device != "cpu" else "cpu"
    extra = {"MODEL_URI": str(model_dir), "PORT": str(port), "MODEL_DEVICE": device, "DRAIN_SECONDS": "0"}
    if device == "cpu":
        extra["CUDA_VISIBLE_DEVICES"] = ""  # as the backends start a service given no GPU
    log = work / f"serve-{tag}-{key}.log"
    started = time.monotonic()
    srv = Served(start([sys.executable, "-m", "runtime.serve"], child_env(work, **extra), log), port)
    while True:
        if srv.proc.poll() is not None:
            check(
                False,
                f"{tag} ready on {device}",
                f"the server exited {srv.proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}",
            )
            return None
        if time.monotonic() - started > STARTUP_S:
            stop(srv.proc)
            check(
                False,
                f"{tag} ready on {device}",
                f"not ready after {STARTUP_S:.0f} s:\n{log.read_text(errors='replace')[-3000:]}",
            )
            return None
        try:
            if srv.request("GET", "/readyz")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    result(f"{tag}_{key}_ready_s", time.monotonic() - started)
    ready = json.loads(srv.request("GET", "/readyz")[2])
    want = "cuda:0" if key == "gpu" else "cpu"
    check(ready.get("device") == want, f"{tag} /readyz says device {want}", f"it says {ready.get('device')!r}")
    _, headers, version = srv.request("GET", "/version")
    check(headers.get("x-model-device") == want, f"{tag} /version's X-Model-Device is {want}", str(headers))
    print(f"{tag} on {device}: ready; /version {version.decode()!r}", flush=True)
    for line in log.read_text(errors="replace").splitlines():
        if " is on " in line or "model ready" in line:
            print("  " + line.split(" runtime.serve: ")[-1], flush=True)
    if key == "gpu":
        result(f"{tag}_gpu_server_mib", gpu_mib(srv.proc.pid) or "n/a")
    return srv


def answers(srv: Served, bodies: list[bytes], what: str) -> list[Any]:
    """The predictions for each body; empty (a failed check) when one is not answered."""
    out = []
    for body in bodies:
        status, _, text = srv.request("POST", "/invocations", body)
        if status != 200:
            check(False, f"{what} answers its requests", f"{status}: {text[:500]!r}")
            return []
        out.append(json.loads(text)["predictions"])
    check(True, f"{what} answers its requests")
    return out


# ---------------------------------------------------------------------------------------------------- the load


def _connection(port: int, request: bytes, warm: float, end: float, limit: int, out: dict[str, Any]) -> None:
    """One closed-loop keep-alive connection until ``end``: into ``out`` (its own), the latencies of the requests
    answered between ``warm`` and ``end``, the errors and the first error."""
    latencies, errors, sample, sock = [], 0, None, None
    for _ in range(limit):
        if time.time() >= end:
            break
        try:
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=120)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            began = time.perf_counter()
            sock.sendall(request)
            status, close, body = _response(sock)
            took = time.perf_counter() - began
        except OSError as exc:
            errors, sample = errors + 1, sample or repr(exc)
            close, status = True, 0
        if close and sock is not None:
            sock.close()
            sock = None
        if status == 200 and warm <= time.time() <= end:
            latencies.append(took)
        elif status not in (0, 200):
            errors, sample = errors + 1, sample or f"{status}: {body[:300]!r}"
    if sock is not None:
        sock.close()
    out.update(latencies=latencies, errors=errors, sample=sample)


def _response(sock: socket.socket) -> tuple[int, bool, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    headers = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(max(65536, length - len(body)))
        if not chunk:
            raise ConnectionError("closed inside a response")
        body += chunk
    return int(lines[0].split()[1]), headers.get("connection") == "close", body


def _client(port: int, request: bytes, connections: int, warm: float, end: float, limit: int) -> list[dict[str, Any]]:
    outs: list[dict[str, Any]] = [{} for _ in range(connections)]
    threads = [threading.Thread(target=_connection, args=(port, request, warm, end, limit, out)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def measure(srv: Served, name: str, body: bytes, concurrency: int, seconds: float, rows: int = 1) -> dict[str, float]:
    """Closed-loop load: ``concurrency`` connections over client processes (spawned: no fork of a process that
    imported torch), a second of warm-up, then ``seconds``; requests/s and p50/p99 latency."""
    import multiprocessing

    processes = max(1, min(8, (os.cpu_count() or 2) // 2, concurrency))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    request = (
        b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    warm = time.time() + 3.0  # the processes' start (2 s at most), then a second of warm-up
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        outs = [
            out
            for outs in pool.starmap(_client, [(srv.port, request, n, warm, warm + seconds, 200_000) for n in shares])
            for out in outs
        ]
    latencies = np.array([x for out in outs for x in out["latencies"]])
    errors = sum(out["errors"] for out in outs)
    sample = next((out["sample"] for out in outs if out["sample"]), None)
    stats = {
        "rps": len(latencies) / seconds,
        "errors": float(errors),
        "n": float(len(latencies)),
        "p50_ms": float(np.percentile(latencies, 50) * 1000) if len(latencies) else math.nan,
        "p99_ms": float(np.percentile(latencies, 99) * 1000) if len(latencies) else math.nan,
    }
    print(
        f"  {name}: {stats['rps']:.0f} requests/s ({stats['rps'] * rows:.0f} rows/s), p50 {stats['p50_ms']:.2f} ms,"
        f" p99 {stats['p99_ms']:.2f} ms, {len(latencies)} requests, {errors} errors",
        flush=True,
    )
    ERRORS[0] += errors
    check(errors == 0 and len(latencies) > 0, f"{name}: answered without errors", f"{errors} errors; first: {sample}")
    return stats


# ---------------------------------------------------------------------------------------------------- the models


def manifest(model_dir: Path, work: Path) -> None:
    from runtime.manifest import HashCache, write_manifest

    write_manifest(model_dir, HashCache(work / "hashes"))


def serve_both(
    tag: str,
    model_dir: Path,
    work: Path,
    gpu: bool,
    bodies: list[bytes],
    tolerance: float,
    loads: list[tuple[str, bytes, int, float, int]],
    cpu_share: float = 1.0,
) -> dict[str, list[dict[str, float]]]:
    """Serve the model on the GPU (when there is one), then on the CPU: the device checks, the answers to
    ``bodies`` compared, and each load ``(name, body, concurrency, seconds, rows)`` measured (on the CPU for
    ``cpu_share`` of the seconds: a slow model's side). The measurements of each device that served."""
    manifest(model_dir, work)
    got: dict[str, list[Any]] = {}
    stats: dict[str, list[dict[str, float]]] = {}
    for device in (["cuda"] if gpu else []) + ["cpu"]:
        srv = serve(model_dir, device, work, tag, gpu)
        if srv is None:
            continue
        key = "gpu" if device != "cpu" else "cpu"
        try:
            got[key] = answers(srv, bodies, f"{tag} on {device}")
            share = 1.0 if key == "gpu" else cpu_share
            stats[key] = [
                measure(srv, f"{tag} {name} on {device}", body, concurrency, max(3.0, seconds * share), rows)
                for name, body, concurrency, seconds, rows in loads
            ]
        finally:
            stop(srv.proc)
    if got.get("gpu") and got.get("cpu"):
        worst = max(
            float(np.max(np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float))))
            for a, b in zip(got["gpu"], got["cpu"], strict=True)
        )
        result(f"{tag}_gpu_cpu_max_abs_diff", worst)
        check(worst <= tolerance, f"{tag}: GPU and CPU answers agree within {tolerance:g}", f"max abs diff {worst:g}")
    return stats


def digits_phase(model_dir: Path, work: Path, gpu: bool, seconds: float) -> None:
    phase("serving the digits model (saved from the CPU with torch.export) on the GPU and on the CPU")
    sys.path.insert(0, str(DIGITS))
    import data  # examples/digits/data.py: the held-out rows

    x = np.concatenate([data.load_digits_split()[part][0] for part in ("test", "val")])[:512]
    rows = [json.dumps({"inputs": x[i : i + 1].tolist()}).encode() for i in range(4)]
    big = json.dumps({"inputs": x.tolist()}).encode()
    example = (model_dir / "serving_input_example.json").read_bytes()
    loads = [
        ("1-row requests, concurrency 32", rows[0], 32, seconds, 1),
        (f"{len(x)}-row requests, concurrency 8", big, 8, seconds, len(x)),
    ]
    for key, (one, many) in serve_both("G0", model_dir, work, gpu, [example, *rows, big], 1e-4, loads).items():
        for name, value in [
            ("rps", one["rps"]),
            ("p50_ms", one["p50_ms"]),
            ("p99_ms", one["p99_ms"]),
            ("512_rows_per_s", many["rps"] * len(x)),
            ("512_p99_ms", many["p99_ms"]),
        ]:
            result(f"G0_digits_{key}_{name}", value)


def heavy_model(quick: bool) -> tuple[Any, np.ndarray]:
    """A transformer encoder over token ids with random weights (eval mode), and a 2-row example."""
    import torch
    from torch import nn

    width, layers, seq, vocab = (128, 2, 32, 1000) if quick else (512, 8, 128, 1000)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.randn(seq, width) * 0.02)
            layer = nn.TransformerEncoderLayer(
                width, 8, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, 10)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.head(self.encoder(self.embed(ids) + self.pos).mean(dim=1)), dim=1)

    torch.manual_seed(0)
    return Encoder().eval(), np.random.default_rng(0).integers(0, vocab, (2, seq), dtype=np.int64)


def heavy_phase(work: Path, gpu: bool, quick: bool, seconds: float) -> None:
    phase("serving a heavy model (a transformer encoder, random weights) on the GPU and on the CPU")
    import mlflow.pytorch

    net, example = heavy_model(quick)
    model_dir = work / "heavy-transformer"
    shutil.rmtree(model_dir, ignore_errors=True)
    started = time.monotonic()
    mlflow.pytorch.save_model(net, str(model_dir), input_example=example, pip_requirements=["torch"])
    print(
        f"saved with torch.export in {time.monotonic() - started:.0f} s "
        f"({sum(p.numel() for p in net.parameters()) / 1e6:.1f} M parameters)",
        flush=True,
    )
    probe = np.random.default_rng(1).integers(0, 1000, (3, example.shape[1]))
    bodies = [(model_dir / "serving_input_example.json").read_bytes(), json.dumps({"inputs": probe.tolist()}).encode()]
    one = json.dumps({"inputs": probe[:1].tolist()}).encode()
    stats = serve_both(
        "G1",
        model_dir,
        work,
        gpu,
        bodies,
        1e-3,
        [("1-row requests, concurrency 64", one, 64, seconds, 1)],
        cpu_share=0.6,
    )
    for key, (load,) in stats.items():
        result(f"G1_{key}_rps", load["rps"])
        result(f"G1_{key}_p99_ms", load["p99_ms"])
    both = "gpu" in stats and "cpu" in stats and stats["cpu"][0]["rps"] > 0
    result("G1_gpu_vs_cpu", stats["gpu"][0]["rps"] / stats["cpu"][0]["rps"] if both else "n/a")
    result("G1_p99_ms", stats["gpu"][0]["p99_ms"] if "gpu" in stats else "n/a")


# ---------------------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="the CPU half only (the default without a GPU)")
    parser.add_argument("--quick", action="store_true", help="a smaller transformer, shorter training and load")
    parser.add_argument("--seconds", type=float, default=None, help="each load phase (12; 3 with --quick)")
    parser.add_argument("--skip", action="append", default=[], choices=("train", "digits", "heavy"))
    parser.add_argument("--workdir", type=Path, help="keep what the check writes here")
    args = parser.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 12.0)

    import torch

    gpu = not args.cpu_only and torch.cuda.is_available()  # asks the driver; makes no CUDA context in this process
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{os.cpu_count()} cores; GPU: {'yes' if gpu else 'no: the CPU half only'}",
        flush=True,
    )
    if gpu:
        print(
            "nvidia-smi:",
            nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"),
            flush=True,
        )
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        final = None if "train" in args.skip else train(work, gpu, args.quick)
        if "digits" not in args.skip:
            served = work / "digits-served"
            shutil.copytree(final or plain_digits_model(work), served, dirs_exist_ok=True)
            digits_phase(served, work, gpu, seconds)
        if "heavy" not in args.skip:
            heavy_phase(work, gpu, args.quick, seconds)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    result("G_errors", ERRORS[0])
    result("G_total_s", time.monotonic() - started)
    print(f"\n{'ALL CHECKS PASSED' if not FAILURES else 'FAILED: ' + '; '.join(FAILURES)}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
