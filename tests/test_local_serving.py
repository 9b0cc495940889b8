"""LocalServing's server process: what it sees of the orchestrator's environment."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from blocks.base.serving import Release
from blocks.local.serving import LocalServing
from blocks.records import ServerSpec
from blocks.specs import ServingSpec

# A workload's own server that answers every prediction with the environment it runs in.
ENV_SERVER = """
import json, os
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer({"ready": True})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer({"env": dict(os.environ)})

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

HTTPServer((os.environ["HOST"], int(os.environ["PORT"])), Handler).serve_forever()
"""


def test_the_server_gets_the_contract_and_what_it_asks_for_not_the_orchestrators_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_KEY", "planted-prefect-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted-aws-secret")
    monkeypatch.setenv("GPUFERRY_TEST_PASSED", "passed-on-purpose")
    (tmp_path / "server.py").write_text(ENV_SERVER)
    serving = LocalServing(state_dir=str(tmp_path / "serving"), drain_seconds=2, pass_env=["GPUFERRY_TEST_PASSED"])
    service = f"envprobe-{uuid.uuid4().hex[:8]}"
    release = Release(
        model_name="envprobe",
        version="1",
        model_uri="s3://models/envprobe/1",
        server=ServerSpec(
            command=["python", "server.py"],
            workdir=str(tmp_path),
            prediction_path="/predict",
            env={"FROM_SERVE_SECTION": "yes"},
        ),
        store_env={"AWS_ACCESS_KEY_ID": SecretStr("the-stores-key")},
    )
    endpoint = serving.deploy(ServingSpec(service_name=service, smoke_request={"inputs": [[1.0]]}), release)
    try:
        env = httpx.post(f"{endpoint.url}/predict", json={"inputs": [[1.0]]}, timeout=30).json()["env"]
    finally:
        serving.undeploy(service)
    assert env["MODEL_URI"] == "s3://models/envprobe/1" and env["PORT"] == endpoint.url.rsplit(":", 1)[1]
    assert env["FROM_SERVE_SECTION"] == "yes" and env["GPUFERRY_TEST_PASSED"] == "passed-on-purpose"
    assert env["AWS_ACCESS_KEY_ID"] == "the-stores-key" and env["PATH"] == os.environ["PATH"]
    assert "PREFECT_API_KEY" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert "planted-prefect-key" not in str(env) and "planted-aws-secret" not in str(env)
