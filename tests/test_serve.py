"""runtime/serve.py as a real process on a free port, serving MLflow models built here in moments.

Three models: a torch MLP on scikit-learn's digits (``mlflow.pytorch``, one float32 tensor), an ElasticNet on the
diabetes data (``mlflow.sklearn``, ten named double columns), and a pyfunc model from code that echoes a column
scaled by a param and can hold the predict thread until the test lets it go. Answers are compared with
``mlflow.pyfunc.load_model(dir).predict`` and with ``mlflow models serve`` on the same requests.

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
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd
import pytest

from blocks.base.storage import write_manifest
from runtime import contract
from runtime.checkpoint import UnverifiedCheckpoint, fetch_checkpoint
from runtime.contract import ManifestError

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 300.0  # seconds; only ever a bound on a wait for a condition

MAX_QUEUE = 32
MAX_REQUEST_ROWS = 128
ECHO_MAX_BYTES = 2000


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------- the models

ECHO_MODEL = '''
import os
import time

import mlflow
import numpy as np

GATE, STARTED, RELEASE = -1.0, {started!r}, {release!r}


class Echo(mlflow.pyfunc.PythonModel):
    """x * scale per row; a row x == -1 holds the predict thread (in a Python loop, GIL held) until RELEASE
    exists; total=True answers one row for the whole input (not one per row)."""

    def predict(self, context, model_input, params=None):
        params = params or {{}}
        x = model_input["x"].to_numpy()
        if (x == GATE).any():
            open(STARTED, "w").close()
            while not os.path.exists(RELEASE):
                pass
        y = x * params.get("scale", 1.0)
        return np.array([y.sum()]) if params.get("total", False) else y


mlflow.models.set_model(Echo())
'''


@dataclass(frozen=True)
class Models:
    digits: Path  # mlflow.pytorch, signature: tensor float32 (-1, 64)
    regressor: Path  # mlflow.sklearn (scaler + ElasticNet pipeline), signature: ten double columns
    echo: Path  # pyfunc from code, signature: column x (double), params scale (double), total (boolean)
    gate_started: Path
    gate_release: Path
    digits_x: np.ndarray  # held-out rows
    regressor_x: pd.DataFrame


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    import mlflow.pyfunc
    import mlflow.pytorch
    import mlflow.sklearn
    import torch
    from mlflow.models import infer_signature
    from sklearn.datasets import load_diabetes, load_digits
    from sklearn.linear_model import ElasticNet
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    root = tmp_path_factory.mktemp("models")
    digits = load_digits()
    x = (digits.data / 16).astype(np.float32)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.Adam(mlp.parameters(), lr=1e-2)
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(
            mlp(torch.from_numpy(x[:1400])), torch.from_numpy(digits.target[:1400])
        ).backward()
        optimizer.step()
    # A 2-row example: torch.export keeps a batch dimension of 1 static. pip_requirements: no slow inference.
    mlflow.pytorch.save_model(mlp.eval(), root / "digits", input_example=x[:2], pip_requirements=["torch"])

    diabetes = load_diabetes(as_frame=True)
    # As examples/diabetes: a scaler and ElasticNet fitted on a DataFrame (its feature names checked at predict).
    regressor = make_pipeline(StandardScaler(), ElasticNet(alpha=0.01, l1_ratio=0.5))
    regressor.fit(diabetes.data[:400], diabetes.target[:400])
    mlflow.sklearn.save_model(
        regressor, root / "regressor", input_example=diabetes.data.iloc[:3], pip_requirements=["scikit-learn"]
    )

    started, release = root / "gate-started", root / "gate-release"
    code = root / "echo_model.py"
    code.write_text(ECHO_MODEL.format(started=str(started), release=str(release)))
    example = pd.DataFrame({"x": [1.0, 2.0]})
    mlflow.pyfunc.save_model(
        root / "echo",
        python_model=str(code),
        input_example=(example, {"scale": 1.0}),
        signature=infer_signature(example, example["x"].to_numpy(), params={"scale": 1.0, "total": False}),
        pip_requirements=["mlflow"],
    )
    for name in ("digits", "regressor", "echo"):
        write_manifest(root / name)
    return Models(
        root / "digits", root / "regressor", root / "echo", started, release, x[1400:], diabetes.data.iloc[400:]
    )


def predict(model_dir: Path, data: Any, params: dict | None = None) -> Any:
    """What the model itself answers, JSON-ready."""
    import mlflow.pyfunc

    out = mlflow.pyfunc.load_model(str(model_dir)).predict(data, params=params)
    return np.asarray(out).tolist()


# --------------------------------------------------------------------------------------------- the servers


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    startup: list[dict] = field(default_factory=list)  # what the probes and /invocations said while starting

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, payload: object, content_type: str = "application/json", **kwargs: Any) -> httpx.Response:
        content = json.dumps(payload) if isinstance(payload, (dict, list)) else payload
        return httpx.post(
            f"{self.url}/invocations", content=content, headers={"content-type": content_type}, timeout=60, **kwargs
        )

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


def launch(model_uri: Path | str, log_path: Path, argv: list[str] | None = None, **settings: object) -> Server:
    """Start our server (not waiting for it)."""
    port = _free_port()
    env = {
        **os.environ,
        contract.MODEL_URI: model_uri if isinstance(model_uri, str) else model_uri.as_uri(),
        contract.PORT: str(port),
        **{k: str(v) for k, v in settings.items()},
    }
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv or [sys.executable, "-m", "runtime.serve"],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return Server(proc, port, log_path)


def follow_until_ready(server: Server, probe: object) -> Server:
    """Poll the probes (and /invocations with ``probe``) until /readyz says 200, recording what they said."""
    deadline = time.monotonic() + DEADLINE
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while True:
            assert server.proc.poll() is None, f"server exited with {server.proc.returncode}:\n{server.log()}"
            assert time.monotonic() < deadline, f"server not ready after {DEADLINE:.0f} s:\n{server.log()}"
            try:
                healthz = client.get("/healthz")
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            readyz = client.get("/readyz")
            seen = {
                "healthz": healthz.status_code,
                "readyz": readyz.status_code,
                "state": readyz.json()["state"],
                "ping": client.get("/ping").status_code,
            }
            if readyz.status_code == 200:
                server.startup.append(seen)
                return server
            answer = client.post("/invocations", json=probe)
            seen |= {"invocations": answer.status_code, "retry_after": answer.headers.get("retry-after")}
            server.startup.append(seen)
            time.sleep(0.05)


def start(model_uri: Path | str, log_path: Path, probe: object, **settings: object) -> Server:
    return follow_until_ready(launch(model_uri, log_path, **settings), probe)


def mlflow_serve(model_dir: Path, log_path: Path) -> Server:
    """``mlflow models serve`` on the same model directory (not waiting for it)."""
    port = _free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = [
        str(Path(sys.executable).parent / "mlflow"),
        "models",
        "serve",
        "-m",
        str(model_dir),
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, port, log_path)


def stop_group(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


def digits_body(rows: np.ndarray) -> dict:
    return {"inputs": rows.tolist()}


@dataclass
class Servers:
    digits: Server
    regressor: Server
    echo: Server
    mlflow_digits: Server
    mlflow_regressor: Server


@pytest.fixture(scope="module")
def servers(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Ours for each model and ``mlflow models serve`` for the first two, started side by side."""
    logs = tmp_path_factory.mktemp("server-logs")
    common = {"MAX_QUEUE": MAX_QUEUE, "MAX_REQUEST_ROWS": MAX_REQUEST_ROWS, "DRAIN_SECONDS": 0}
    ours = {
        "digits": launch(models.digits, logs / "digits.log", **common),
        "regressor": launch(models.regressor, logs / "regressor.log", **common),
        "echo": launch(models.echo, logs / "echo.log", **common, MAX_REQUEST_BYTES=ECHO_MAX_BYTES),
    }
    theirs = {
        "mlflow_digits": mlflow_serve(models.digits, logs / "mlflow-digits.log"),
        "mlflow_regressor": mlflow_serve(models.regressor, logs / "mlflow-regressor.log"),
    }
    try:
        probes = {
            "digits": digits_body(models.digits_x[:1]),
            "regressor": {"dataframe_records": models.regressor_x.iloc[:1].to_dict("records")},
            "echo": {"dataframe_records": [{"x": 1.0}]},
        }
        with ThreadPoolExecutor(max_workers=len(ours)) as pool:  # each followed from its start
            for done in [pool.submit(follow_until_ready, ours[name], probe) for name, probe in probes.items()]:
                done.result()
        for name, srv in theirs.items():
            wait_for(lambda srv=srv: _answers(f"{srv.url}/ping"), f"{name} to answer /ping\n{srv.log()}")
        yield Servers(**ours, **theirs)
    finally:
        for srv in theirs.values():
            stop_group(srv)
        codes = {name: srv.terminate() for name, srv in ours.items()}
    assert codes == dict.fromkeys(ours, 0), {name: ours[name].log()[-3000:] for name in ours}


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.TransportError:
        return False


# ------------------------------------------------------------------------------------------ raw requests


def connect(port: int) -> socket.socket:
    """A connection the server has accepted and served once (GET /healthz), so a request sent on it later is
    read in the server's next turn; requests on brand-new connections trickle in over several turns."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 200
    return sock


def send_invocation(sock: socket.socket, payload: object) -> None:
    body = json.dumps(payload).encode()
    sock.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
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


def post_all_at_once(server: Server, payloads: list[object]) -> list[tuple[int, dict[str, str], Any]]:
    """POST every payload on its own connection so that the server reads them all in the same turn."""
    socks = [connect(server.port) for _ in payloads]
    try:
        with server.frozen():
            for sock, payload in zip(socks, payloads, strict=True):
                send_invocation(sock, payload)
        return [read_response(sock) for sock in socks]  # every one is answered: none is left to time out
    finally:
        for sock in socks:
            sock.close()


# ------------------------------------------------------------------------------------ start-up and probes


def test_not_ready_until_loaded_and_warmed_up(servers: Servers) -> None:
    for srv in (servers.digits, servers.regressor, servers.echo):
        not_ready = [seen for seen in srv.startup if seen["readyz"] == 503]
        assert not_ready, f"/readyz never said 503 during start-up: {srv.startup}"
        for i, seen in enumerate(not_ready):
            assert seen["healthz"] == 200 and seen["state"] in ("loading", "warming-up"), seen
            # /ping and /invocations are tried just after /readyz: on the last not-ready round the model may
            # have come up in between.
            if i < len(not_ready) - 1:
                assert seen["ping"] == 503 and seen["invocations"] == 503 and seen["retry_after"] is not None, seen
        assert srv.startup[-1] == {"healthz": 200, "readyz": 200, "state": "ready", "ping": 200}
        assert "model ready" in srv.log()


def test_readyz_names_the_model_but_not_where_it_is_stored(servers: Servers, models: Models) -> None:
    for srv, model_dir, flavor in (
        (servers.digits, models.digits, "pytorch"),
        (servers.regressor, models.regressor, "sklearn"),
    ):
        response = httpx.get(f"{srv.url}/readyz", timeout=30)
        info = response.json()
        assert info["ready"] is True and info["state"] == "ready"
        manifest = (model_dir / contract.MANIFEST_FILENAME).read_bytes()
        assert info["model"]["checkpoint_sha256"] == hashlib.sha256(manifest).hexdigest()
        assert info["model"]["flavors"] == sorted(["python_function", flavor])
        assert info["model"]["loader_module"] == f"mlflow.{flavor}"
        assert info["model"]["name"] == "model" and info["model"]["has_serving_input_example"] is True
        assert info["model"]["signature"]["inputs"][0]["type"] == ("tensor" if flavor == "pytorch" else "double")
        assert str(model_dir.parent) not in response.text and "file:" not in response.text
        assert httpx.get(f"{srv.url}/", timeout=30).json()["model"] == info["model"]
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        version = httpx.get(f"{srv.url}/version", timeout=30).text
        assert version == httpx.get(f"{servers.mlflow_digits.url}/version", timeout=30).text


def test_probes_answer_while_a_slow_predict_holds_the_predict_thread(servers: Servers, models: Models) -> None:
    srv = servers.echo
    models.gate_release.unlink(missing_ok=True)
    models.gate_started.unlink(missing_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        held = pool.submit(srv.post, {"dataframe_records": [{"x": -1.0}]})
        wait_for(models.gate_started.exists, "the slow predict to start")
        queued = pool.submit(srv.post, {"dataframe_records": [{"x": 3.0}]})
        try:
            # The predict thread spins in Python (holding the GIL but for the interpreter's switches): the event
            # loop still answers the probes, and the request behind the slow one waits for the thread.
            for _ in range(5):
                assert httpx.get(f"{srv.url}/healthz", timeout=30).status_code == 200
                ready = httpx.get(f"{srv.url}/readyz", timeout=30)
                assert ready.status_code == 200 and ready.json()["state"] == "ready"
                assert httpx.get(f"{srv.url}/ping", timeout=30).status_code == 200
            wait_for(lambda: srv.metrics()["inference_queue_depth"] == 1, "the second request to be queued")
            assert not held.done() and not queued.done()
        finally:
            models.gate_release.touch()
        assert held.result().json() == {"predictions": [-1.0]}
        assert queued.result().json() == {"predictions": [3.0]}


def test_metrics_are_prometheus_text(servers: Servers) -> None:
    response = httpx.get(f"{servers.digits.url}/metrics", timeout=30)
    assert response.headers["content-type"].startswith("text/plain")
    for family, kind in [
        ("inference_requests_total", "counter"),
        ("inference_request_duration_seconds", "histogram"),
        ("inference_batch_size", "histogram"),
        ("inference_batch_requests", "histogram"),
        ("inference_predict_duration_seconds", "histogram"),
        ("inference_batch_fallbacks_total", "counter"),
        ("inference_queue_depth", "gauge"),
        ("inference_ready", "gauge"),
    ]:
        assert f"# TYPE {family} {kind}" in response.text
    metrics = servers.digits.metrics()
    assert (
        metrics['inference_request_duration_seconds_bucket{le="+Inf"}']
        == metrics["inference_request_duration_seconds_count"]
    )
    assert metrics["inference_ready"] == 1


def test_unknown_routes_and_methods(servers: Servers) -> None:
    assert httpx.get(f"{servers.digits.url}/predict", timeout=30).status_code == 404
    response = httpx.get(f"{servers.digits.url}/invocations", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert httpx.post(f"{servers.digits.url}/readyz", timeout=30).status_code == 405


# ----------------------------------------------------------------------------------------- the protocol


def _regressor_requests(frame: pd.DataFrame) -> list[tuple[object, str]]:
    return [
        ({"dataframe_split": frame.to_dict(orient="split")}, "application/json"),  # with "index", as pandas writes
        ({"dataframe_split": {"columns": list(frame.columns), "data": frame.to_numpy().tolist()}}, "application/json"),
        ({"dataframe_records": frame.to_dict(orient="records")}, "application/json"),
        ({"instances": frame.to_dict(orient="records")}, "application/json"),
        ({"inputs": frame.to_dict(orient="list")}, "application/json"),
        ({"dataframe_split": frame[list(frame.columns)[::-1]].to_dict(orient="split")}, "application/json"),
        (frame.to_csv(index=False), "text/csv"),
        (frame.to_csv(index=False), "text/csv; charset=utf-8"),
    ]


def _digits_requests(rows: np.ndarray) -> list[tuple[object, str]]:
    columns = [str(i) for i in range(rows.shape[1])]
    return [
        ({"inputs": rows.tolist()}, "application/json"),
        ({"instances": rows.tolist()}, "application/json"),
        ({"inputs": rows.tolist(), "params": {"ignored": 1}}, "application/json"),  # no params in its signature
        ({"dataframe_split": {"columns": columns, "data": rows.tolist()}}, "application/json"),
        ({"dataframe_records": [dict(zip(columns, r, strict=True)) for r in rows.tolist()]}, "application/json"),
    ]


def test_answers_equal_the_models_own_and_mlflow_serves(servers: Servers, models: Models) -> None:
    frame = models.regressor_x.iloc[:5]
    rows = models.digits_x[:4]
    expected_regressor = predict(models.regressor, frame)
    expected_digits = predict(models.digits, rows)
    cases = [
        (servers.regressor, servers.mlflow_regressor, req, expected_regressor) for req in _regressor_requests(frame)
    ]
    cases += [(servers.digits, servers.mlflow_digits, req, expected_digits) for req in _digits_requests(rows)]
    for ours, theirs, (payload, content_type), expected in cases:
        answer, reference = ours.post(payload, content_type), theirs.post(payload, content_type)
        assert answer.status_code == reference.status_code == 200, (payload, answer.text, reference.text)
        assert answer.json() == reference.json(), payload
        np.testing.assert_allclose(answer.json()["predictions"], expected, rtol=1e-5, atol=1e-6)


def test_params_are_passed_and_batches_never_mix_them(servers: Servers, models: Models) -> None:
    srv = servers.echo
    example = json.loads((models.echo / "serving_input_example.json").read_text())
    assert example["params"] == {"scale": 1.0}  # MLflow wrote the params of the input example too
    assert srv.post(example).json() == {"predictions": [1.0, 2.0]}
    for scale in (1.0, 2.5):
        frame = pd.DataFrame({"x": [1.0, 4.0]})
        assert srv.post({"dataframe_split": frame.to_dict("split"), "params": {"scale": scale}}).json() == {
            "predictions": predict(models.echo, frame, {"scale": scale})
        }
    # Concurrent requests with two scales, and some with total=True (one answer row for the whole input: the
    # batch cannot be split by rows, so each request is predicted alone).
    payloads = [
        {"dataframe_records": [{"x": float(i)}, {"x": float(i) + 0.5}], "params": params}
        for i, params in enumerate([{"scale": 1.0}, {"scale": 3.0}, {"total": True}, {}] * 4)
    ]
    before = srv.metrics()
    responses = post_all_at_once(srv, payloads)
    after = srv.metrics()
    for payload, (status, _, body) in zip(payloads, responses, strict=True):
        xs = [r["x"] for r in payload["dataframe_records"]]
        assert status == 200, body
        assert body == {"predictions": predict(models.echo, pd.DataFrame({"x": xs}), payload["params"])}
    assert after["inference_batch_fallbacks_total"] > before["inference_batch_fallbacks_total"]
    assert after["inference_batch_size_count"] - before["inference_batch_size_count"] < len(payloads)


@pytest.mark.parametrize(
    ("payload", "fragments"),
    [
        pytest.param({"inputs": [[0.0] * 63]}, ['"inputs[0]"', "63 values", "expects 64"], id="short-row"),
        pytest.param({"inputs": [[0.0] * 64, [0.0] * 65]}, ['"inputs[1]"', "65 values"], id="ragged"),
        pytest.param({"instances": [[0.0] * 10 + ["abc"] + [0.0] * 53]}, ['"instances[0][10]"', "string"], id="string"),
        pytest.param({"inputs": [[0.0] * 63 + [1e39]]}, ['"inputs[0][63]"', "out of range", "float32"], id="overflow"),
        pytest.param({"inputs": [0.0] * 64}, ['"inputs[0]"', "list of 64", '{"inputs": [[...]]}'], id="flat"),
        pytest.param({"inputs": [[[0.0] * 64]]}, ['"inputs[0]"', "1 values", "expects 64"], id="3-d"),
        pytest.param({"inputs": []}, ['"inputs" is empty'], id="empty"),
        pytest.param(
            {"inputs": [[0.0] * 64] * (MAX_REQUEST_ROWS + 1)},
            [f"{MAX_REQUEST_ROWS + 1} rows", "MAX_REQUEST_ROWS"],
            id="too-many-rows",
        ),
    ],
)
def test_a_tensor_that_does_not_match_the_signature_is_422(
    servers: Servers, payload: dict, fragments: list[str]
) -> None:
    response = servers.digits.post(payload)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_code"] == "INVALID_PARAMETER_VALUE"
    for fragment in fragments:
        assert fragment in body["message"], body["message"]
    assert servers.mlflow_digits.post(payload).status_code in (200, 400)  # MLflow: a 400 with a dump, or worse


def _diabetes_columns() -> list[str]:
    return ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


@pytest.mark.parametrize(
    ("payload", "fragments"),
    [
        pytest.param(
            {"dataframe_split": {"columns": _diabetes_columns()[1:], "data": [[0.0] * 9]}},
            ["missing column 'age'", "requires"],
            id="missing-column",
        ),
        pytest.param(
            {"dataframe_records": [dict.fromkeys(_diabetes_columns(), 0.0) | {"bmi": "high"}]},
            ["column 'bmi'", "double", "\"dataframe_records[0]['bmi']\"", "a string"],
            id="string-in-double-column",
        ),
        pytest.param(
            {
                "dataframe_records": [
                    dict.fromkeys(_diabetes_columns(), 0.0),
                    dict.fromkeys(_diabetes_columns()[:-1], 0.0),
                ]
            },
            ['"dataframe_records[1]"', "no column 's6'"],
            id="record-without-a-column",
        ),
        pytest.param(
            {"dataframe_split": {"columns": _diabetes_columns(), "data": [[0.0] * 10, [0.0] * 9]}},
            ['"dataframe_split.data[1]"', "9 values", "names 10"],
            id="short-row",
        ),
        pytest.param(
            {"dataframe_split": {"columns": _diabetes_columns(), "data": [[0.0] * 10], "index": [0, 1]}},
            ['"dataframe_split.index"'],
            id="index-length",
        ),
        pytest.param(
            {"inputs": {c: [0.0] for c in _diabetes_columns()[:-2]}}, ["s5", "s6", "signature"], id="slow-path-missing"
        ),
    ],
)
def test_columns_that_do_not_match_the_signature_are_422(servers: Servers, payload: dict, fragments: list[str]) -> None:
    response = servers.regressor.post(payload)
    assert response.status_code == 422, response.text
    for fragment in fragments:
        assert fragment in response.json()["message"], response.json()["message"]
    assert servers.mlflow_regressor.post(payload).status_code in (200, 400)


@pytest.mark.parametrize(
    ("content", "content_type", "status", "fragment"),
    [
        pytest.param(b'{"inputs": [[0.0, ', "application/json", 400, "valid JSON", id="invalid-json"),
        pytest.param(b"[[0.0]]", "application/json", 400, "Received a list", id="a-list"),
        pytest.param(b'{"rows": [[0.0]]}', "application/json", 400, "exactly one of", id="no-format"),
        pytest.param(b'{"inputs": [], "instances": []}', "application/json", 400, "exactly one of", id="two-formats"),
        pytest.param(b"<xml/>", "application/xml", 415, "text/csv", id="xml"),
        pytest.param(b"{}", "application/json; charset=latin-1", 415, "UTF-8", id="charset"),
    ],
)
def test_a_body_that_is_not_the_protocol(
    servers: Servers, content: bytes, content_type: str, status: int, fragment: str
) -> None:
    response = servers.digits.post(content, content_type)
    assert response.status_code == status, response.text
    assert fragment in response.json()["message"]
    assert servers.mlflow_digits.post(content, content_type).status_code == status


def test_a_body_past_max_request_bytes_is_413(servers: Servers) -> None:
    rows = [{"x": 1.0}] * (ECHO_MAX_BYTES // len('{"x": 1.0}, ') + 10)
    response = servers.echo.post({"dataframe_records": rows})
    assert response.status_code == 413 and "MAX_REQUEST_BYTES" in response.json()["message"]
    chunked = servers.echo.post(iter([json.dumps({"dataframe_records": rows}).encode()]))  # no Content-Length
    assert chunked.status_code == 413
    assert servers.echo.post({"dataframe_records": rows[:5]}).status_code == 200


# ---------------------------------------------------------------------------------- batching and overload


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(servers: Servers, models: Models) -> None:
    srv = servers.digits
    sizes = [1 + i % 3 for i in range(MAX_QUEUE)]  # 63 rows: within one batch of MAX_BATCH_SIZE (64)
    offsets = np.cumsum([0, *sizes])
    requests = [models.digits_x[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]
    alone = [srv.post(digits_body(rows)).json() for rows in requests]  # one at a time: each runs alone

    before = srv.metrics()
    responses = post_all_at_once(srv, [digits_body(rows) for rows in requests])
    after = srv.metrics()

    for rows, single, (status, _, body) in zip(requests, alone, responses, strict=True):
        assert status == 200, body
        # Equal up to float32 rounding: the BLAS kernels of a 63-row and a 2-row matmul sum in other orders.
        np.testing.assert_allclose(body["predictions"], single["predictions"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(body["predictions"], predict(models.digits, rows), rtol=1e-5, atol=1e-6)
    passes = after["inference_batch_size_count"] - before["inference_batch_size_count"]
    rows_run = after["inference_batch_size_sum"] - before["inference_batch_size_sum"]
    served = after['inference_requests_total{code="200"}'] - before['inference_requests_total{code="200"}']
    assert served == len(requests) and rows_run == sum(sizes)
    assert 1 <= passes < len(requests), f"{passes} predict calls for {len(requests)} concurrent requests"
    assert after["inference_batch_requests_sum"] - before["inference_batch_requests_sum"] == len(requests)


def test_concurrent_column_requests_are_one_dataframe_per_batch(servers: Servers, models: Models) -> None:
    srv = servers.regressor
    frames = [models.regressor_x.iloc[i : i + 1 + i % 2] for i in range(MAX_QUEUE)]  # 48 rows, 1 or 2 each
    payloads = [
        {"dataframe_split": f.to_dict("split")} if i % 2 else {"dataframe_records": f.to_dict("records")}
        for i, f in enumerate(frames)
    ]
    before = srv.metrics()
    responses = post_all_at_once(srv, payloads)
    after = srv.metrics()
    for frame, (status, _, body) in zip(frames, responses, strict=True):
        assert status == 200, body
        np.testing.assert_allclose(body["predictions"], predict(models.regressor, frame), rtol=1e-7)
    passes = after["inference_batch_size_count"] - before["inference_batch_size_count"]
    assert 1 <= passes < len(payloads), f"{passes} predict calls for {len(payloads)} concurrent requests"
    assert after["inference_batch_fallbacks_total"] == before["inference_batch_fallbacks_total"]


def test_a_bad_request_never_fails_the_batch_it_would_have_joined(servers: Servers, models: Models) -> None:
    good = [digits_body(models.digits_x[i : i + 1]) for i in range(8)]
    responses = post_all_at_once(servers.digits, [*good[:4], {"inputs": [[0.0] * 63]}, *good[4:]])
    assert [status for status, _, _ in responses] == [200] * 4 + [422] + [200] * 4


def test_overload_is_503_with_retry_after(servers: Servers, models: Models) -> None:
    srv = servers.digits
    before = srv.metrics()
    payloads = [digits_body(models.digits_x[i : i + 1]) for i in range(MAX_QUEUE + 16)]
    responses = post_all_at_once(srv, payloads)
    statuses = [status for status, _, _ in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= MAX_QUEUE
    for payload, (status, headers, body) in zip(payloads, responses, strict=True):
        if status == 503:
            assert int(headers["retry-after"]) >= 1 and "overloaded" in body["message"]
        else:
            np.testing.assert_allclose(
                body["predictions"],
                predict(models.digits, np.array(payload["inputs"], np.float32)),
                rtol=1e-5,
                atol=1e-6,
            )
    after = srv.metrics()
    refused = after['inference_requests_total{code="503"}'] - before.get('inference_requests_total{code="503"}', 0)
    assert refused == statuses.count(503)
    assert after["inference_queue_depth"] == 0


# ------------------------------------------------------------------------------------------------- drain


def test_sigterm_under_load_drops_no_request(models: Models, tmp_path: Path) -> None:
    srv = follow_until_ready(
        launch(
            models.digits,
            tmp_path / "serve.log",
            argv=[sys.executable, str(REPO / "runtime" / "serve.py")],
            DRAIN_SECONDS=3,
            WARMUP_ITERATIONS=1,
        ),  # the script form, not -m
        digits_body(models.digits_x[:1]),
    )
    try:
        outcome = asyncio.run(_load_through_sigterm(srv, models))
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


async def _load_through_sigterm(srv: Server, models: Models, workers: int = 8) -> _LoadOutcome:
    """Keep ``workers`` clients busy, SIGTERM the server, and stop sending only once /readyz has said 503 and
    every client has had a request served after that (as a load balancer would, a moment after readiness)."""
    outcome = _LoadOutcome(after_not_ready=[0] * workers)
    not_ready = asyncio.Event()
    stop = asyncio.Event()
    completed = 0

    async def client_loop(i: int) -> None:
        nonlocal completed
        rows = models.digits_x[i * 4 : i * 4 + 4]
        async with httpx.AsyncClient(base_url=srv.url, timeout=DEADLINE) as client:
            first = (await client.post("/invocations", json=digits_body(rows))).json()
            while not stop.is_set():
                began_after = not_ready.is_set()
                try:
                    response = await client.post("/invocations", json=digits_body(rows))
                    if response.status_code != 200 or response.json() != first:
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
            assert (await probe.get("/ping")).status_code == 503
        not_ready.set()
        await wait_until(lambda: all(outcome.after_not_ready), "every client to be served while draining")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return outcome


# ------------------------------------------------------------------------------------ checkpoint checks


def _copy(checkpoint: Path, dest: Path) -> Path:
    shutil.copytree(checkpoint, dest)
    return dest


def _tamper(path: Path) -> tuple[str, str]:
    """Flip one byte (same size); returns the sha256 before and after."""
    data = bytearray(path.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)
    return before, hashlib.sha256(data).hexdigest()


def test_fetch_checkpoint_copies_only_verified_files(models: Models, tmp_path: Path) -> None:
    source = _copy(models.regressor, tmp_path / "source")
    (source / "not-listed.txt").write_text("not in the manifest")
    manifest = json.loads((source / contract.MANIFEST_FILENAME).read_bytes())
    for i, uri in enumerate((source.as_uri(), str(source))):
        checkpoint = fetch_checkpoint(uri, tmp_path / f"dest{i}")
        assert checkpoint.sha256 == hashlib.sha256((source / contract.MANIFEST_FILENAME).read_bytes()).hexdigest()
        assert checkpoint.files == len(manifest["files"])
        copied = sorted(p.relative_to(checkpoint.path).as_posix() for p in checkpoint.path.rglob("*") if p.is_file())
        assert copied == sorted([e["path"] for e in manifest["files"]] + [contract.MANIFEST_FILENAME])
    with pytest.raises(FileNotFoundError):
        fetch_checkpoint((tmp_path / "missing").as_uri(), tmp_path / "x")
    with pytest.raises(ValueError, match="is a file"):
        fetch_checkpoint(str(source / "MLmodel"), tmp_path / "x")
    with pytest.raises(ValueError, match="unsupported scheme"):
        fetch_checkpoint("gs://bucket/model", tmp_path / "x")


def test_fetch_checkpoint_refuses_what_does_not_match_its_manifest(models: Models, tmp_path: Path) -> None:
    bad = _copy(models.regressor, tmp_path / "bad")
    expected, actual = _tamper(bad / "model.skops")
    size = (bad / "model.skops").stat().st_size
    with pytest.raises(UnverifiedCheckpoint) as refused:
        fetch_checkpoint(bad.as_uri(), tmp_path / "dest")
    assert str(refused.value).startswith(
        f"{bad}/model.skops: sha256 {actual} ({size} bytes) but MANIFEST.json says {expected} ({size} bytes)"
    )
    assert not (tmp_path / "dest" / "model.skops").exists()  # nothing unverified lands in the destination

    (bad / "MLmodel").write_text("truncated")
    _copy(models.regressor, tmp_path / "good").joinpath("model.skops").replace(bad / "model.skops")
    with pytest.raises(UnverifiedCheckpoint, match=r"MLmodel: sha256 \w+ \(9 bytes\) but .* says"):
        fetch_checkpoint(bad.as_uri(), tmp_path / "dest")
    (bad / "MLmodel").unlink()
    with pytest.raises(UnverifiedCheckpoint, match="MLmodel: listed in MANIFEST.json but missing"):
        fetch_checkpoint(bad.as_uri(), tmp_path / "dest")

    (bad / contract.MANIFEST_FILENAME).unlink()
    with pytest.raises(UnverifiedCheckpoint, match="has no MANIFEST.json: refusing to serve"):
        fetch_checkpoint(bad.as_uri(), tmp_path / "dest")
    (bad / contract.MANIFEST_FILENAME).write_text('{"files": "all of them"}')
    with pytest.raises(ManifestError, match="is not a gpuferry manifest"):
        fetch_checkpoint(bad.as_uri(), tmp_path / "dest")


def _run_to_exit(model_uri: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, contract.MODEL_URI: model_uri, contract.PORT: str(_free_port()), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "runtime.serve"], cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE
    )


def test_a_checkpoint_that_cannot_be_verified_is_never_served(models: Models, tmp_path: Path) -> None:
    corrupt = _copy(models.digits, tmp_path / "corrupt")
    target = next(p for p in sorted((corrupt / "data").rglob("*")) if p.is_file())
    expected, actual = _tamper(target)
    unlisted = _copy(models.digits, tmp_path / "no-manifest")
    (unlisted / contract.MANIFEST_FILENAME).unlink()
    no_mlmodel = _copy(models.digits, tmp_path / "no-mlmodel")
    (no_mlmodel / "MLmodel").unlink()
    write_manifest(no_mlmodel)
    cases = [
        (corrupt, [f"{target}: sha256 {actual}", f"MANIFEST.json says {expected}"]),
        (unlisted, ["has no MANIFEST.json: refusing to serve"]),
        (no_mlmodel, ["holds no MLmodel", "save_model"]),
        (tmp_path / "missing", ["no checkpoint directory"]),
    ]
    for model_dir, fragments in cases:
        proc = _run_to_exit(model_dir.as_uri())
        assert proc.returncode == 1, proc.stderr
        assert "could not load the model" in proc.stderr and "model ready" not in proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, proc.stderr


def test_a_checkpoint_that_is_not_the_registered_one_is_refused(models: Models, tmp_path: Path) -> None:
    """MODEL_SHA256 is the manifest's sha256 the model version records: a checkpoint replaced since is refused."""
    source = _copy(models.regressor, tmp_path / "replaced")
    registered = hashlib.sha256((source / contract.MANIFEST_FILENAME).read_bytes()).hexdigest()
    assert fetch_checkpoint(source.as_uri(), tmp_path / "ok", registered).sha256 == registered
    (source / "extra.txt").write_text("added after registration")
    replaced = write_manifest(source)  # a consistent checkpoint, but another one
    with pytest.raises(
        UnverifiedCheckpoint, match=f"has sha256 {replaced}, but the model version records {registered}"
    ):
        fetch_checkpoint(source.as_uri(), tmp_path / "refused", registered)
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())  # nothing fetched
    proc = _run_to_exit(source.as_uri(), {contract.MODEL_SHA256: registered})
    assert proc.returncode == 1 and "is not the one that was registered" in proc.stderr, proc.stderr
    bad = _run_to_exit(source.as_uri(), {contract.MODEL_SHA256: "abc"})
    assert bad.returncode == 2 and "MODEL_SHA256='abc' is not a sha256" in bad.stderr


def test_a_bad_setting_exits_2_naming_it() -> None:
    proc = _run_to_exit("/nowhere", {"MAX_BATCH_SIZE": "many"})
    assert proc.returncode == 2 and "MAX_BATCH_SIZE='many' is not an integer" in proc.stderr


# ---------------------------------------------------------------------------------------------------- s3


@pytest.mark.integration
def test_serves_a_verified_s3_checkpoint_and_refuses_a_corrupt_one(
    models: Models, s3_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.stacks import stack_env

    aws = {k: v for k, v in stack_env("s3").items() if k.startswith("AWS_")}  # what the server reads
    for name, value in aws.items():
        monkeypatch.setenv(name, value)
    ref = s3_store.put(models.regressor, "regressor/run1")
    assert ref.sha256 == hashlib.sha256((models.regressor / contract.MANIFEST_FILENAME).read_bytes()).hexdigest()

    frame = models.regressor_x.iloc[:3]
    srv = start(ref.uri, tmp_path / "serve.log", {"dataframe_records": frame.to_dict("records")}, DRAIN_SECONDS=0)
    try:
        info = httpx.get(f"{srv.url}/readyz", timeout=30)
        assert info.json()["model"]["checkpoint_sha256"] == ref.sha256 and "s3:" not in info.text
        answer = srv.post({"dataframe_split": frame.to_dict("split")})
        assert answer.json()["predictions"] == predict(models.regressor, frame)
    finally:
        assert srv.terminate() == 0, srv.log()

    # The model object replaced by other bytes of the same size, its metadata claiming the old sha256.
    s3 = s3_store.bucket.credentials.get_s3_client()
    bucket = s3_store.bucket.bucket_name
    prefix = ref.uri.removeprefix(f"s3://{bucket}/")
    good = s3.get_object(Bucket=bucket, Key=f"{prefix}/model.skops")
    data = bytearray(good["Body"].read())
    expected = hashlib.sha256(data).hexdigest()
    data[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=f"{prefix}/model.skops", Body=bytes(data), Metadata=good["Metadata"])
    with pytest.raises(UnverifiedCheckpoint) as refused:
        fetch_checkpoint(ref.uri, tmp_path / "scratch")
    assert str(refused.value).startswith(
        f"{ref.uri}/model.skops: sha256 {hashlib.sha256(data).hexdigest()} ({len(data)} bytes) "
        f"but MANIFEST.json says {expected} ({len(data)} bytes)"
    )
    proc = _run_to_exit(ref.uri)
    assert proc.returncode == 1 and "model.skops: sha256" in proc.stderr, proc.stderr
    # No manifest (an upload that did not finish): refused, and the server exits without becoming ready.
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/{contract.MANIFEST_FILENAME}")
    with pytest.raises(UnverifiedCheckpoint, match="has no MANIFEST.json: refusing to serve"):
        fetch_checkpoint(ref.uri, tmp_path / "scratch")
    proc = _run_to_exit(ref.uri)
    assert proc.returncode == 1 and "has no MANIFEST.json" in proc.stderr, proc.stderr


def test_model_agnostic_parts_import_neither_mlflow_nor_gpuferry() -> None:
    code = (
        "import sys; import runtime.checkpoint, runtime.batching, runtime.metrics, runtime.settings; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlflow', 'numpy', 'pandas', 'prefect', 'blocks', 'tasks', 'flows', 'deployments')); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_batcher_groups_by_key_and_raises_errors_to_their_callers_alone() -> None:
    from runtime.batching import Batcher, Overloaded

    calls: list[list[tuple[str, int]]] = []
    threads: set[str] = set()

    def predict_many(items: list[tuple[str, int]]) -> list[Any]:
        threads.add(threading.current_thread().name)
        calls.append(items)
        return [ValueError(f"bad {n}") if n < 0 else f"{key}:{n * 10}" for key, n in items]

    async def scenario() -> tuple[list[Any], BaseException]:
        batcher: Batcher[tuple[str, int], str] = Batcher(predict_many, max_batch_size=4, max_queue=8)
        batcher.start()
        items = [("a", 1), ("b", 2), ("a", 3), ("a", -4), ("b", 5), ("a", 6), ("a", 7), ("a", 8)]
        results = await asyncio.gather(*(batcher.submit(i, key=i[0]) for i in items), return_exceptions=True)
        overflow = [asyncio.ensure_future(batcher.submit(("c", n), key="c")) for n in range(9)]
        refused = await asyncio.gather(*overflow, return_exceptions=True)
        await batcher.close()
        return results, next(r for r in refused if isinstance(r, BaseException))

    results, refused = asyncio.run(scenario())
    assert results[:3] == ["a:10", "b:20", "a:30"] and isinstance(results[3], ValueError)
    assert results[4:] == ["b:50", "a:60", "a:70", "a:80"]
    assert isinstance(refused, Overloaded)
    assert all(len({key for key, _ in call}) == 1 and len(call) <= 4 for call in calls), calls
    assert calls[0] == [("a", 1), ("a", 3), ("a", -4), ("a", 6)]  # oldest first, one key, up to 4 rows
    assert len(threads) == 1 and threading.current_thread().name not in threads
