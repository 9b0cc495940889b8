"""runtime/front.py, the service's front on a Docker host, as its container runs it (`python -m runtime.front`),
in front of two stand-in versions (HTTP/1.1 servers of the standard library). No engine needed: the
container-level switch is in tests/test_docker_serving.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from runtime import front

REPO = Path(__file__).resolve().parent.parent


class Version(ThreadingHTTPServer):
    """A stand-in version of the service: answers with its name."""

    daemon_threads = True

    def __init__(self, name: str, port: int = 0) -> None:
        self.name = name
        self.connections = 0  # accepted
        super().__init__(("127.0.0.1", port), Handler)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> Version:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Version

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        self.server.connections += 1
        super().setup()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size)
                self.rfile.read(2)
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, status: int, body: bytes, **headers: str) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_POST(self) -> None:
        body = self._body()
        seen = {
            "version": self.server.name,
            "bytes": len(body),
            "connection": self.headers.get("Connection"),
            "expect": self.headers.get("Expect"),
        }
        self._answer(200, json.dumps(seen).encode(), **{"Content-Type": "application/json"})

    def do_HEAD(self) -> None:
        self._answer(200, b"hello")

    def do_GET(self) -> None:
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"one ", b"two ", b"three"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/until-close":  # no length: the body ends with the connection
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"all of it")
            self.close_connection = True
        elif self.path == "/empty":
            self.send_response(204)
            self.end_headers()
        else:
            self._answer(200, self.server.name.encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_front(tmp_path: Path) -> Iterator:
    """Start `python -m runtime.front` aimed at a target; its URL and target file."""
    started: list[subprocess.Popen] = []

    def start(target: str, connect_timeout: float = 10) -> tuple[str, Path]:
        port, target_file = free_port(), tmp_path / "front" / "target"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            front.PORT_ENV: str(port),
            front.TARGET_ENV: target,
            front.TARGET_FILE_ENV: str(target_file),
            front.SHADOW_FILE_ENV: str(target_file.parent / "shadow"),
            front.CONNECT_TIMEOUT_ENV: str(connect_timeout),
        }
        process = subprocess.Popen([sys.executable, "-m", "runtime.front"], env=env, stderr=subprocess.PIPE)
        started.append(process)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                assert time.monotonic() < deadline, "the front never listened"
                time.sleep(0.05)
        return f"http://127.0.0.1:{port}", target_file

    yield start
    for process in started:
        process.terminate()
        assert process.wait(30) == 0  # SIGTERM: it stops and exits 0


def set_target(target_file: Path, *targets: str) -> None:
    """What the deploy runs in the front's container (docker exec)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), front.TARGET_FILE_ENV: str(target_file)}
    subprocess.run([sys.executable, "-m", "runtime.front", "set", *targets], env=env, check=True, timeout=60)


def test_a_switch_under_steady_load_loses_no_request_and_what_starts_after_it_reaches_the_new_version(
    run_front,
) -> None:
    with Version("v1") as v1, Version("v2") as v2:
        url, target_file = run_front(v1.target)
        answers: list[tuple[float, str, int]] = []  # (when the request started, version, status)
        failures: list[str] = []
        stop = threading.Event()

        def ask(keep_alive: bool) -> None:
            client = httpx.Client(timeout=30) if keep_alive else None
            while not stop.is_set():
                started = time.monotonic()
                try:
                    if client is not None:
                        reply = client.post(f"{url}/invocations", json={"inputs": [[1, 2]]})
                    else:
                        reply = httpx.post(f"{url}/invocations", json={"inputs": [[1, 2]]}, timeout=30)
                    answers.append(
                        (started, reply.json()["version"] if reply.status_code == 200 else "", reply.status_code)
                    )
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
            if client is not None:
                client.close()

        askers = [threading.Thread(target=ask, args=(i % 2 == 0,)) for i in range(4)]
        for t in askers:
            t.start()
        try:
            wait_for(lambda: len(answers) > 50)
            switched = time.monotonic()
            set_target(target_file, v2.target)
            done = time.monotonic()
            wait_for(lambda: sum(1 for a in answers if a[0] > done) > 50)
        finally:
            stop.set()
            for t in askers:
                t.join(60)
    assert not failures, failures[:5]
    assert {status for _, _, status in answers} == {200}
    assert {version for start, version, _ in answers if start < switched} == {"v1"}
    assert {version for start, version, _ in answers if start > done} == {"v2"}  # keep-alive clients too


def test_messages_keep_their_framing(run_front) -> None:
    with Version("v1") as v1:
        url, _ = run_front(v1.target)
        with httpx.Client(timeout=30) as client:  # one keep-alive connection through all of them
            body = b"x" * 200_000
            reply = client.post(f"{url}/echo", content=iter([body[:1000], body[1000:]]))  # sent chunked
            assert reply.status_code == 200 and reply.json()["bytes"] == len(body)
            assert reply.json()["connection"] is None  # kept upstream (HTTP/1.1)
            assert client.get(f"{url}/chunked").text == "one two three"
            head = client.head(f"{url}/")
            assert head.status_code == 200 and head.headers["content-length"] == "5" and head.content == b""
            assert client.get(f"{url}/empty").status_code == 204
            assert client.get(f"{url}/").text == "v1"
            assert v1.connections == 1  # one kept connection upstream for all of these
            assert client.get(f"{url}/until-close").text == "all of it"  # ends that connection
            assert client.get(f"{url}/").text == "v1"
            assert v1.connections == 2
        # Expect: 100-continue is answered by the front; the version never sees it.
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            raw.sendall(b"abc")
            reply_bytes = b""
            while b'"expect": null}' not in reply_bytes:
                chunk = raw.recv(4096)
                assert chunk, reply_bytes
                reply_bytes += chunk
            assert b'"bytes": 3' in reply_bytes


def test_a_target_that_refuses_is_tried_again_then_a_502(run_front, tmp_path: Path) -> None:
    port = free_port()
    url, _ = run_front(f"127.0.0.1:{port}", connect_timeout=20)
    result: list[httpx.Response] = []
    asker = threading.Thread(target=lambda: result.append(httpx.get(f"{url}/", timeout=60)))
    asker.start()
    time.sleep(0.5)  # the version (re)starts while the request waits for it
    with Version("late", port=port):
        asker.join(60)
    assert result and result[0].status_code == 200 and result[0].text == "late"

    url, _ = run_front(f"127.0.0.1:{free_port()}", connect_timeout=0.5)
    reply = httpx.get(f"{url}/", timeout=60)
    assert reply.status_code == 502 and "no version of the service answers" in reply.text


class ClosesKeptConnections:
    """A version that answers the first request of each connection and closes the connection when the next one
    arrives, without a byte of an answer: its idle timeout closing a kept connection as the front reuses it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            conn.recv(65536)  # the next request on this connection: closed unanswered


def test_a_kept_connection_the_version_closed_is_tried_again_on_a_new_one(run_front) -> None:
    version = ClosesKeptConnections()
    try:
        url, _ = run_front(version.target)
        with httpx.Client(timeout=30) as client:
            answers = [client.post(f"{url}/invocations", json={"inputs": [[i]]}) for i in range(3)]
        assert [(a.status_code, a.text) for a in answers] == [(200, "ok")] * 3
        assert version.connections == 3  # each reuse met a closed connection and went on a new one
    finally:
        version.listener.close()


def test_set_refuses_what_is_not_host_and_port(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), front.TARGET_FILE_ENV: str(tmp_path / "target")}
    bad = subprocess.run(
        [sys.executable, "-m", "runtime.front", "set", "no-port"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "'no-port' is not host:port" in bad.stderr
    assert not (tmp_path / "target").exists()
    set_target(tmp_path / "target", "v2-abc123-digits:8080")
    assert (tmp_path / "target").read_text() == "v2-abc123-digits:8080\n"
    assert front.parse_target("v2-abc123-digits:8080") == ("v2-abc123-digits", 8080)


def test_weighted_targets_split_the_requests_by_weight_evenly_spaced(run_front, tmp_path: Path) -> None:
    with Version("v1") as v1, Version("v2") as v2:
        url, target_file = run_front(v1.target)
        set_target(target_file, f"{v1.target}=9", f"{v2.target}=1")
        with httpx.Client(timeout=60) as client:
            answers = [client.get(f"{url}/x").text for _ in range(200)]
            assert answers.count("v2") == 20 and answers.count("v1") == 180
            assert [i for i, a in enumerate(answers) if a == "v2"] == list(range(answers.index("v2"), 200, 10))
            set_target(target_file, v2.target)  # the canary passed: all of it
            assert {client.get(f"{url}/x").text for _ in range(20)} == {"v2"}
    env = {**os.environ, "PYTHONPATH": str(REPO), front.TARGET_FILE_ENV: str(tmp_path / "other")}
    for bad, why in (
        (["a:1=0", "b:2=1"], "the weight must be a number above 0"),
        (["a:1=x"], "the weight must be a number above 0"),
        (["a:1", "a:1=2"], "'a:1' is named twice"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "runtime.front", "set", *bad], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and why in done.stderr, done.stderr


def test_a_shadow_gets_a_copy_of_a_share_of_the_scoring_requests_and_clients_only_the_versions_answers(
    run_front,
) -> None:
    with Version("v1") as v1, Version("v2") as v2:
        url, target_file = run_front(v1.target)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            front.SHADOW_FILE_ENV: str(target_file.parent / "shadow"),
        }

        def front_cli(*args: str) -> str:
            done = subprocess.run(
                [sys.executable, "-m", "runtime.front", *args], env=env, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        front_cli("shadow", f"http://{v2.target}/invocations", "0.5")
        with httpx.Client(timeout=60) as client:
            answers = [client.post(f"{url}/invocations", json={"x": i}).json() for i in range(20)]
            assert {a["version"] for a in answers} == {"v1"}  # never the shadow's
            assert {client.get(f"{url}/x").text for _ in range(5)} == {"v1"}  # not a scoring request: no copy

            def counts() -> dict[str, float]:
                return {
                    k: float(v)
                    for k, v in (line.rsplit(" ", 1) for line in front_cli("stats").splitlines() if line[:1] != "#")
                }

            wait_for(lambda: counts().get('inference_shadow_requests_total{code="200"}') == 10)
            assert counts()['inference_shadow_rows_total{result="disagree"}'] == 10  # v2 answers with its own name
            for _ in range(2):  # bodies past 64 KiB are streamed through, not held: not copied
                big = client.post(f"{url}/invocations", json={"x": "a" * 70_000})
                assert big.json()["version"] == "v1" and big.json()["bytes"] > 70_000
            front_cli("shadow", "off")
            client.post(f"{url}/invocations", json={"x": 0})
            time.sleep(1.5)  # the front writes its counts every 0.5 s: none any more
            assert counts()['inference_shadow_requests_total{code="200"}'] == 10
        bad = subprocess.run(
            [sys.executable, "-m", "runtime.front", "shadow", f"http://{v2.target}/invocations", "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and "SHADOW_SHARE='2' must be above 0 and at most 1" in bad.stderr


def test_the_rollout_state_and_a_decision_by_hand_live_beside_the_target(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), front.TARGET_FILE_ENV: str(tmp_path / "front" / "target")}

    def front_cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "runtime.front", "rollout", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    refused = front_cli("decide", "promote")
    assert refused.returncode == 3 and "no canary or shadow window is under way" in refused.stderr
    assert front_cli("set", '{"version": "2", "share": 0.1}').returncode == 0
    assert json.loads(front_cli("show").stdout) == {"version": "2", "share": 0.1}
    assert front_cli("decision").stdout == ""
    assert front_cli("decide", "abort").returncode == 0 and front_cli("decision").stdout == "abort"
    assert front_cli("decide", "later").returncode == 2 and front_cli("set", "{not json").returncode == 2
    assert front_cli("clear").returncode == 0
    assert front_cli("show").stdout == "" and front_cli("decision").stdout == ""


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
