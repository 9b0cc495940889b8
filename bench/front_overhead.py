"""What the service's front (runtime/front.py) adds to a request: latency of one keep-alive client, and the
requests a second of several clients, straight to a stand-in version and through the front, on this machine.

The version is a small uvicorn app (what gpuferry's model server runs on), so the figures are the front's own
cost, not a model's. Prints ``RESULT front_added_ms_p50``, ``RESULT front_added_ms_p99``, ``RESULT
front_cpu_ms_per_request`` (the front process's CPU time over the latency rounds, per request: what it takes
from the host's cores whatever the load) and ``RESULT front_throughput_ratio`` (through the front / straight,
8 clients).

    .venv/bin/python bench/front_overhead.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime import front

APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = b'{"predictions": [1]}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"process on port {port} did not start") from None
            time.sleep(0.05)


def latencies(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            start = time.perf_counter()
            assert client.post(f"{url}/invocations", json={"inputs": [[1.0, 2.0]]}).status_code == 200
            out.append((time.perf_counter() - start) * 1000)
    return out


def throughput(url: str, clients: int, seconds: float) -> float:
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def ask(i: int) -> None:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < stop:
                assert client.post(f"{url}/invocations", json={"inputs": [[1.0]]}).status_code == 200
                counts[i] += 1

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    version_port, front_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    app_dir = REPO / ".bench-front"
    app_dir.mkdir(exist_ok=True)
    (app_dir / "bench_app.py").write_text(APP)
    version = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(app_dir),
            "--port",
            str(version_port),
            "--log-level",
            "warning",
            "bench_app:app",
        ],
        env=env,
    )
    proxy = subprocess.Popen(
        [sys.executable, "-m", "runtime.front"],
        env={
            **env,
            front.PORT_ENV: str(front_port),
            front.TARGET_ENV: f"127.0.0.1:{version_port}",
            front.TARGET_FILE_ENV: str(app_dir / "target"),
        },
    )
    try:
        wait_listening(version_port, version)
        wait_listening(front_port, proxy)
        straight_url, front_url = f"http://127.0.0.1:{version_port}", f"http://127.0.0.1:{front_port}"
        latencies(straight_url, 200), latencies(front_url, 200)  # warm up
        straight, through = [], []
        front_cpu = 0.0
        for _ in range(4):  # alternating rounds: load on the machine hits both alike
            straight += latencies(straight_url, args.requests // 4)
            before = cpu_seconds(proxy.pid)
            through += latencies(front_url, args.requests // 4)
            front_cpu += cpu_seconds(proxy.pid) - before
        rate_straight = throughput(straight_url, 8, args.seconds / 2)
        rate_through = throughput(front_url, 8, args.seconds / 2)
    finally:
        for process in (proxy, version):
            process.terminate()
            process.wait(30)
        for path in app_dir.iterdir():
            path.unlink()
        app_dir.rmdir()
    p50 = statistics.median(through) - statistics.median(straight)
    p99 = pct(through, 99) - pct(straight, 99)
    print(
        f"straight: p50 {statistics.median(straight):.3f} ms p99 {pct(straight, 99):.3f} ms, {rate_straight:.0f} req/s "
        f"(8 clients); through the front: p50 {statistics.median(through):.3f} ms p99 {pct(through, 99):.3f} ms, "
        f"{rate_through:.0f} req/s"
    )
    print(f"RESULT front_added_ms_p50 {p50:.3f}")
    print(f"RESULT front_added_ms_p99 {p99:.3f}")
    print(f"RESULT front_cpu_ms_per_request {front_cpu * 1000 / len(through):.3f}")
    print(f"RESULT front_throughput_ratio {rate_through / rate_straight:.3f}")


if __name__ == "__main__":
    main()
