"""workload/serve.py as a real process on a free port, serving a model trained here in moments.

Every wait is a poll for a condition with a generous deadline. Where a test needs requests to reach the server
at the same moment (batching, overload), it opens the connections first, freezes the server with SIGSTOP, sends
the requests over raw sockets (the kernel buffers the bytes) and resumes it with SIGCONT: the server then reads
them all in one turn of its event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from blocks.storage import MANIFEST, write_manifest
from workload import contract
from workload.contract import ManifestError
from workload.data import load_digits_split
from workload.model import build_model
from workload.serve import UnverifiedCheckpoint, fetch_model
from tests.stacks import stack_env

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 120.0  # seconds; only ever a bound on a wait for a condition

MAX_QUEUE = 32
MAX_REQUEST_ROWS = 128
WARMUP_ITERATIONS = 2_000  # long enough (a few tenths of a second) that the not-ready phase is observable


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Trained:
    model: torch.nn.Module
    checkpoint: Path  # the final/ directory holding model.pt, metrics.json and MANIFEST.json
    checkpoint_sha256: str  # of its MANIFEST.json
    x: np.ndarray  # held-out rows to classify

    def expected(self, rows: np.ndarray) -> tuple[list[int], np.ndarray]:
        with torch.inference_mode():
            probabilities = torch.softmax(self.model(torch.from_numpy(rows)), dim=1).numpy()
        return probabilities.argmax(axis=1).tolist(), probabilities


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only contends
    try:
        config = {"hidden": 32}
        model = build_model(config)
        split = load_digits_split()
        x, y = (torch.from_numpy(a) for a in split["train"])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(100):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    checkpoint = tmp_path_factory.mktemp("checkpoint") / contract.FINAL_DIRNAME
    checkpoint.mkdir()
    torch.save({"state_dict": model.state_dict(), "config": config}, checkpoint / contract.MODEL_FILENAME)
    (checkpoint / contract.METRICS_FILENAME).write_text('{"val_accuracy": 0.9}')
    return Trained(model, checkpoint, write_manifest(checkpoint), split["test"][0])


# --------------------------------------------------------------------------------------------- the server


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    startup: list[dict] = field(default_factory=list)  # what /healthz, /readyz and /predict said while starting

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {
            name: float(value)
            for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
        }

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP the server for the block; it reads everything sent meanwhile in one go after SIGCONT."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _proc_state(self.proc.pid) == "T", "the server to stop")
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], checkpoint: Path | str, log_path: Path, **settings: object) -> Server:
    """Start the server and follow it until ready, recording what it answered before that."""
    port = _free_port()
    env = {
        **os.environ,
        contract.MODEL_URI: checkpoint if isinstance(checkpoint, str) else checkpoint.as_uri(),
        contract.PORT: str(port),
        **{k: str(v) for k, v in settings.items()},
    }
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    row = {"inputs": [[0.0] * 64]}
    deadline = time.monotonic() + DEADLINE
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{server.log()}"
            assert time.monotonic() < deadline, f"server not ready after {DEADLINE:.0f} s:\n{server.log()}"
            try:
                healthz = client.get("/healthz")
            except httpx.TransportError:  # not listening yet
                time.sleep(0.02)
                continue
            readyz = client.get("/readyz")
            seen = {"healthz": healthz.status_code, "readyz": readyz.status_code, "state": readyz.json()["state"]}
            if readyz.status_code == 200:
                server.startup.append(seen)
                return server
            predict = client.post("/predict", json=row)
            seen |= {"predict": predict.status_code, "retry_after": predict.headers.get("retry-after")}
            server.startup.append(seen)
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        [sys.executable, "-m", "workload.serve"],
        trained.checkpoint,
        tmp_path_factory.mktemp("server") / "serve.log",
        MAX_QUEUE=MAX_QUEUE,
        MAX_REQUEST_ROWS=MAX_REQUEST_ROWS,
        WARMUP_ITERATIONS=WARMUP_ITERATIONS,
        DRAIN_SECONDS=0,
    )
    yield srv
    assert srv.terminate() == 0, srv.log()


# ------------------------------------------------------------------------------------------ raw requests


def connect(port: int) -> socket.socket:
    """A connection the server has accepted and served once (GET /healthz), so a request sent on it later is
    read in the server's next turn; requests on brand-new connections trickle in over several turns."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 200
    return sock


def send_predict(sock: socket.socket, payload: object) -> None:
    body = json.dumps(payload).encode()
    sock.sendall(
        b"POST /predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    while len(body) < int(headers["content-length"]):
        body += _recv(sock)
    return int(status_line.split()[1]), headers, json.loads(body)


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "connection closed before a whole response came"
    return chunk


def post_all_at_once(server: Server, payloads: list[object]) -> list[tuple[int, dict[str, str], dict]]:
    """POST every payload on its own connection so that the server reads them all in the same turn."""
    socks = [connect(server.port) for _ in payloads]
    try:
        with server.frozen():
            for sock, payload in zip(socks, payloads, strict=True):
                send_predict(sock, payload)
        return [read_response(sock) for sock in socks]  # every one is answered: none is left to time out
    finally:
        for sock in socks:
            sock.close()


# --------------------------------------------------------------------------------------------------- tests


def test_not_ready_until_warmed_up(server: Server, trained: Trained) -> None:
    not_ready = [seen for seen in server.startup if seen["readyz"] == 503]
    assert not_ready, f"/readyz never said 503 during start-up: {server.startup}"
    for i, seen in enumerate(not_ready):
        assert seen["healthz"] == 200
        assert seen["state"] in ("loading", "warming-up")
        # /predict is probed just after /readyz: on the last not-ready probe the warm-up may have ended in between.
        if i < len(not_ready) - 1 or seen["predict"] != 200:
            assert seen["predict"] == 503 and seen["retry_after"] is not None, seen
    assert server.startup[-1] == {"healthz": 200, "readyz": 200, "state": "ready"}
    assert "model ready" in server.log()

    info = httpx.get(f"{server.url}/readyz", timeout=30).json()
    sha256 = hashlib.sha256((trained.checkpoint / contract.MODEL_FILENAME).read_bytes()).hexdigest()
    assert info["ready"] is True
    assert info["model"]["uri"] == trained.checkpoint.as_uri()
    assert info["model"]["sha256"] == sha256
    assert info["model"]["checkpoint_sha256"] == trained.checkpoint_sha256
    assert info["model"]["config"] == {"hidden": 32}
    assert httpx.get(f"{server.url}/", timeout=30).json()["model"]["sha256"] == sha256


def test_single_request_matches_the_model(server: Server, trained: Trained) -> None:
    rows = trained.x[:5]
    response = httpx.post(f"{server.url}/predict", json={"inputs": rows.tolist()}, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    predictions, probabilities = trained.expected(rows)
    assert body["predictions"] == predictions
    np.testing.assert_allclose(body["probabilities"], probabilities, rtol=1e-5, atol=1e-6)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(server: Server, trained: Trained) -> None:
    # 32 requests of 1-3 distinct rows each (63 rows: within one batch of MAX_BATCH_SIZE, 64).
    sizes = [1 + i % 3 for i in range(MAX_QUEUE)]
    offsets = np.cumsum([0, *sizes])
    requests = [trained.x[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]

    with httpx.Client(base_url=server.url, timeout=30) as client:  # one at a time: each runs alone
        alone = [client.post("/predict", json={"inputs": rows.tolist()}).json() for rows in requests]

    before = server.metrics()
    responses = post_all_at_once(server, [{"inputs": rows.tolist()} for rows in requests])
    after = server.metrics()

    for rows, single, (status, _, body) in zip(requests, alone, responses, strict=True):
        assert status == 200, body
        predictions, probabilities = trained.expected(rows)
        assert body["predictions"] == single["predictions"] == predictions
        np.testing.assert_allclose(body["probabilities"], single["probabilities"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(body["probabilities"], probabilities, rtol=1e-5, atol=1e-6)

    passes = after["inference_batch_size_count"] - before["inference_batch_size_count"]
    rows_run = after["inference_batch_size_sum"] - before["inference_batch_size_sum"]
    served = after['inference_requests_total{code="200"}'] - before['inference_requests_total{code="200"}']
    assert served == len(requests)
    assert rows_run == sum(sizes)
    assert 1 <= passes < len(requests), f"{passes} forward passes for {len(requests)} concurrent requests"


@pytest.mark.parametrize(
    ("payload", "fragments"),
    [
        pytest.param({"inputs": [[0.0] * 63]}, ['"inputs[0]"', "63 values", "expected 64"], id="short-row"),
        pytest.param({"inputs": [[0.0] * 64, [0.0] * 65]}, ['"inputs[1]"', "65 values"], id="long-row"),
        pytest.param(
            {"inputs": [[0.0] * 10 + ["abc"] + [0.0] * 53]}, ['"inputs[0][10]"', "number", "string"], id="string"
        ),
        pytest.param({"inputs": [[0.0] * 63 + [None]]}, ['"inputs[0][63]"', "null"], id="null"),
        pytest.param({"inputs": [[0.0] * 63 + [True]]}, ['"inputs[0][63]"', "boolean"], id="boolean"),
        pytest.param({"inputs": [[0.0] * 63 + [1e39]]}, ['"inputs[0][63]"', "out of range"], id="float32-overflow"),
        pytest.param({"inputs": [0.0] * 64}, ['"inputs[0]"', "list of 64 numbers", '{"inputs": [[...]]}'], id="flat"),
        pytest.param({"inputs": [[[0.0] * 64]]}, ['"inputs[0]"', "1 values", "expected 64"], id="3-d"),
        pytest.param(
            {"inputs": [[0.0] * 64] * (MAX_REQUEST_ROWS + 1)},
            [f"{MAX_REQUEST_ROWS + 1} rows", "MAX_REQUEST_ROWS"],
            id="too-many-rows",
        ),
        pytest.param({"inputs": []}, ['"inputs"', "non-empty"], id="empty"),
        pytest.param({"instances": [[0.0] * 64]}, ['"inputs" key'], id="wrong-key"),
        pytest.param([[0.0] * 64], ['"inputs" key'], id="not-an-object"),
        pytest.param(b'{"inputs": [[0.0, ', ["invalid JSON"], id="invalid-json"),
    ],
)
def test_malformed_input_is_422_naming_the_problem(server: Server, payload: object, fragments: list[str]) -> None:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    response = httpx.post(
        f"{server.url}/predict", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 422, response.text
    message = response.json()["error"]
    for fragment in fragments:
        assert fragment in message, message


def test_overload_is_503_with_retry_after(server: Server, trained: Trained) -> None:
    before = server.metrics()
    responses = post_all_at_once(server, [{"inputs": [trained.x[i].tolist()]} for i in range(MAX_QUEUE + 16)])

    statuses = [status for status, _, _ in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= MAX_QUEUE
    for i, (status, headers, body) in enumerate(responses):
        if status == 503:
            assert int(headers["retry-after"]) >= 1
            assert "overloaded" in body["error"]
        else:
            assert body["predictions"] == trained.expected(trained.x[i : i + 1])[0]
    after = server.metrics()
    assert after['inference_requests_total{code="503"}'] - before.get('inference_requests_total{code="503"}', 0) == (
        statuses.count(503)
    )
    assert after["inference_queue_depth"] == 0


def test_metrics_are_prometheus_text(server: Server) -> None:
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for family, kind in [
        ("inference_requests_total", "counter"),
        ("inference_request_duration_seconds", "histogram"),
        ("inference_batch_size", "histogram"),
        ("inference_queue_depth", "gauge"),
    ]:
        assert f"# TYPE {family} {kind}" in text
    metrics = server.metrics()
    assert (
        metrics['inference_request_duration_seconds_bucket{le="+Inf"}']
        == metrics["inference_request_duration_seconds_count"]
    )
    assert metrics["inference_ready"] == 1


def test_unknown_routes_and_methods(server: Server) -> None:
    assert httpx.get(f"{server.url}/nope", timeout=30).status_code == 404
    response = httpx.get(f"{server.url}/predict", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_sigterm_under_load_drops_no_request(trained: Trained, tmp_path: Path) -> None:
    srv = start_server(
        [sys.executable, str(REPO / "workload" / "serve.py")],  # the script form, not -m
        trained.checkpoint,
        tmp_path / "serve.log",
        DRAIN_SECONDS=3,
        WARMUP_ITERATIONS=1,
    )
    try:
        outcome = asyncio.run(_load_through_sigterm(srv, trained))
        assert srv.proc.wait(timeout=DEADLINE) == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert outcome.failures == [], outcome.failures
    assert outcome.before_sigterm > 0 and all(n > 0 for n in outcome.after_not_ready)
    assert outcome.closing == sum(outcome.after_not_ready)  # every answer while draining closes its connection
    assert "draining" in srv.log()


@dataclass
class _LoadOutcome:
    before_sigterm: int = 0
    after_not_ready: list[int] = field(default_factory=list)  # per worker: requests begun after readiness fell
    closing: int = 0  # answers to those that said `connection: close` (the client reconnects)
    failures: list[str] = field(default_factory=list)


async def _load_through_sigterm(srv: Server, trained: Trained, workers: int = 8) -> _LoadOutcome:
    """Keep ``workers`` clients busy, SIGTERM the server, and stop sending only once /readyz has said 503 and
    every client has had a request served after that (as a load balancer would, a moment after readiness)."""
    outcome = _LoadOutcome(after_not_ready=[0] * workers)
    not_ready = asyncio.Event()
    stop = asyncio.Event()
    completed = 0

    async def client_loop(i: int) -> None:
        nonlocal completed
        rows = trained.x[i * 4 : i * 4 + 4]
        expected = trained.expected(rows)[0]
        async with httpx.AsyncClient(base_url=srv.url, timeout=DEADLINE) as client:
            while not stop.is_set():
                began_after = not_ready.is_set()
                try:
                    response = await client.post("/predict", json={"inputs": rows.tolist()})
                    if response.status_code != 200 or response.json()["predictions"] != expected:
                        outcome.failures.append(f"{response.status_code}: {response.text}")
                    outcome.closing += began_after and response.headers.get("connection") == "close"
                except httpx.HTTPError as exc:
                    outcome.failures.append(repr(exc))
                completed += 1
                if began_after:
                    outcome.after_not_ready[i] += 1

    async def wait_until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(client_loop(i)) for i in range(workers)]
    try:
        await wait_until(lambda: completed >= 200, "load to build up")
        outcome.before_sigterm = completed
        srv.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=srv.url, timeout=DEADLINE) as probe:
            while (await probe.get("/readyz")).status_code == 200:
                await asyncio.sleep(0.01)
        not_ready.set()
        await wait_until(lambda: all(outcome.after_not_ready), "every client to be served while draining")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return outcome


def test_model_uri_forms(trained: Trained, tmp_path: Path) -> None:
    model_file = trained.checkpoint / contract.MODEL_FILENAME
    for uri in (trained.checkpoint.as_uri(), model_file.as_uri(), str(trained.checkpoint), str(model_file)):
        verified = fetch_model(uri, tmp_path)
        assert verified.data == model_file.read_bytes()
        assert verified.sha256 == hashlib.sha256(model_file.read_bytes()).hexdigest()
        assert verified.checkpoint_sha256 == trained.checkpoint_sha256
    with pytest.raises(FileNotFoundError):
        fetch_model((trained.checkpoint.parent / "missing").as_uri(), tmp_path)
    with pytest.raises(ValueError, match="unsupported scheme"):
        fetch_model("gs://bucket/model", tmp_path)


def _copy(checkpoint: Path, dest: Path) -> Path:
    dest.mkdir()
    for path in checkpoint.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    return dest


def _tamper(path: Path) -> tuple[str, str]:
    """Flip one byte (same size); returns the sha256 before and after."""
    data = bytearray(path.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)
    return before, hashlib.sha256(data).hexdigest()


def test_checkpoint_is_verified_against_its_manifest(trained: Trained, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # A changed model file: named, with the manifest's hash and the file's own.
    bad_model = _copy(trained.checkpoint, tmp_path / "bad-model")
    expected, actual = _tamper(bad_model / contract.MODEL_FILENAME)
    size = (bad_model / contract.MODEL_FILENAME).stat().st_size
    with pytest.raises(UnverifiedCheckpoint) as refused:
        fetch_model(bad_model.as_uri(), scratch)
    assert str(refused.value).startswith(
        f"{bad_model}/model.pt: sha256 {actual} ({size} bytes) but MANIFEST.json says {expected} ({size} bytes)"
    )
    with pytest.raises(UnverifiedCheckpoint, match=f"sha256 {actual}"):  # naming model.pt itself: same check
        fetch_model((bad_model / contract.MODEL_FILENAME).as_uri(), scratch)

    # Every listed file is checked, not only the model: a changed, a truncated and a missing metrics.json.
    bad_metrics = _copy(trained.checkpoint, tmp_path / "bad-metrics")
    expected, actual = _tamper(bad_metrics / contract.METRICS_FILENAME)
    with pytest.raises(UnverifiedCheckpoint, match=f"metrics.json: sha256 {actual} .* says {expected}"):
        fetch_model(bad_metrics.as_uri(), scratch)
    (bad_metrics / contract.METRICS_FILENAME).write_text("{}")
    with pytest.raises(UnverifiedCheckpoint, match=r"metrics.json: sha256 \w+ \(2 bytes\) but .* \(21 bytes\)"):
        fetch_model(bad_metrics.as_uri(), scratch)
    (bad_metrics / contract.METRICS_FILENAME).unlink()
    with pytest.raises(UnverifiedCheckpoint, match="metrics.json: listed in MANIFEST.json but missing"):
        fetch_model(bad_metrics.as_uri(), scratch)

    # No manifest, a manifest that does not list the model, one that is not a manifest: refused.
    unverified = _copy(trained.checkpoint, tmp_path / "no-manifest")
    (unverified / contract.MANIFEST_FILENAME).unlink()
    with pytest.raises(UnverifiedCheckpoint, match="has no MANIFEST.json: refusing to serve"):
        fetch_model(unverified.as_uri(), scratch)
    (unverified / contract.MANIFEST_FILENAME).write_bytes(contract.manifest_bytes({"format": 1, "files": []}))
    with pytest.raises(UnverifiedCheckpoint, match="MANIFEST.json does not list model.pt"):
        fetch_model(unverified.as_uri(), scratch)
    (unverified / contract.MANIFEST_FILENAME).write_text('{"files": "all of them"}')
    with pytest.raises(ManifestError, match="is not a gpuferry manifest"):
        fetch_model(unverified.as_uri(), scratch)


def test_a_corrupt_checkpoint_is_never_served(trained: Trained, tmp_path: Path) -> None:
    bad = _copy(trained.checkpoint, tmp_path / "bad")
    expected, actual = _tamper(bad / contract.MODEL_FILENAME)
    env = {**os.environ, contract.MODEL_URI: bad.as_uri(), contract.PORT: str(_free_port())}
    proc = subprocess.run(
        [sys.executable, "-m", "workload.serve"], cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE
    )
    assert proc.returncode == 1, proc.stderr
    assert "could not load the model" in proc.stderr and "model ready" not in proc.stderr
    assert f"{bad}/model.pt: sha256 {actual}" in proc.stderr and f"MANIFEST.json says {expected}" in proc.stderr


def test_a_model_that_cannot_be_loaded_exits_nonzero(tmp_path: Path) -> None:
    env = {**os.environ, contract.MODEL_URI: (tmp_path / "missing").as_uri(), contract.PORT: str(_free_port())}
    proc = subprocess.run(
        [sys.executable, "-m", "workload.serve"], cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE
    )
    assert proc.returncode == 1, proc.stderr
    assert "could not load the model" in proc.stderr and "no model file" in proc.stderr


@pytest.mark.integration
def test_serves_a_verified_s3_checkpoint_and_refuses_a_corrupt_one(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    from blocks.s3 import S3CheckpointStore

    env = stack_env("s3")
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])  # what the server (and fetch_model here) read
    bucket = f"gpuferry-serve-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=env["S3_ENDPOINT_URL"])
    s3.create_bucket(Bucket=bucket)
    store = S3CheckpointStore(bucket=S3Bucket(bucket_name=bucket, credentials=AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=env["S3_ENDPOINT_URL"]))))  # fmt: skip
    try:
        ref = store.put(trained.checkpoint, "digits/run1")
        assert ref.sha256 == trained.checkpoint_sha256  # the same manifest as the local one

        srv = start_server([sys.executable, "-m", "workload.serve"], ref.uri, tmp_path / "serve.log",
                           WARMUP_ITERATIONS=1, DRAIN_SECONDS=0)  # fmt: skip
        try:
            model = httpx.get(f"{srv.url}/readyz", timeout=30).json()["model"]
            assert model["uri"] == ref.uri and model["checkpoint_sha256"] == ref.sha256
            rows = trained.x[:3]
            answer = httpx.post(f"{srv.url}/predict", json={"inputs": rows.tolist()}, timeout=30)
            assert answer.json()["predictions"] == trained.expected(rows)[0]
        finally:
            assert srv.terminate() == 0, srv.log()

        # The model object replaced by other bytes of the same size, its metadata claiming the old sha256.
        key = f"{ref.uri.removeprefix(f's3://{bucket}/')}/{contract.MODEL_FILENAME}"
        good = s3.get_object(Bucket=bucket, Key=key)
        data = bytearray(good["Body"].read())
        expected = hashlib.sha256(data).hexdigest()
        data[-1] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata=good["Metadata"])
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        with pytest.raises(UnverifiedCheckpoint) as refused:
            fetch_model(ref.uri, scratch)
        assert str(refused.value).startswith(
            f"s3://{bucket}/{key}: sha256 {hashlib.sha256(data).hexdigest()} ({len(data)} bytes) "
            f"but MANIFEST.json says {expected} ({len(data)} bytes)"
        )
        with pytest.raises(UnverifiedCheckpoint, match="sha256"):  # the model file's own URI: the same check
            fetch_model(f"{ref.uri}/{contract.MODEL_FILENAME}", scratch)
        # No manifest (an upload that did not finish): refused, and the server exits without becoming ready.
        s3.delete_object(Bucket=bucket, Key=f"{ref.uri.removeprefix(f's3://{bucket}/')}/{MANIFEST}")
        with pytest.raises(UnverifiedCheckpoint, match="has no MANIFEST.json: refusing to serve"):
            fetch_model(ref.uri, scratch)
        proc = subprocess.run(
            [sys.executable, "-m", "workload.serve"], cwd=REPO, capture_output=True, text=True, timeout=DEADLINE,
            env={**os.environ, contract.MODEL_URI: ref.uri, contract.PORT: str(_free_port())},
        )  # fmt: skip
        assert proc.returncode == 1 and "has no MANIFEST.json" in proc.stderr, proc.stderr
    finally:
        store.delete(f"s3://{bucket}/checkpoints")
        s3.delete_bucket(Bucket=bucket)
