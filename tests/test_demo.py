"""`make demo` and `make demo-stop` as the docs' quick start runs them (``DEMO_COMMANDS``, its command block:
tests/test_docs.py checks they are the same): the whole pipeline on the embedded stack (its own Prefect server, no
outside one), ending with the local endpoint answering the model's own input example; then the server it left
running is stopped. The regressor example, the quicker of the two (the digits example's pipeline is
tests/test_pipeline_embedded.py)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.embedded
DEADLINE_S = 1500  # a cold embedded Prefect server plus training on a busy 2-core machine
# docs/quickstart.md's embedded demo, line by line.
DEMO_COMMANDS = ["make demo DEMO_WORKLOAD=examples/diabetes", "make demo-stop DEMO_WORKLOAD=examples/diabetes"]


def _make(command: str) -> list[str]:
    """A quick start line as run here: make, silent (its own output is what the test reads)."""
    words = command.split()
    assert words[0] == "make"
    return ["make", "-s", *words[1:]]


def _demo_env(home: Path) -> dict[str, str]:
    """This machine's environment less anything that points at a server or state of another run: the demo
    must need none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_", "GPUFERRY_"))}
    return {**env, "GPUFERRY_HOME": str(home)}


def test_make_demo_serves_the_example_and_demo_stop_stops_it(tmp_path: Path) -> None:
    env = _demo_env(tmp_path / "home")
    start, stop_command = DEMO_COMMANDS
    demo = subprocess.run(
        _make(start),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-4000:]
    assert "gpuferry demo: done" in demo.stdout, out[-4000:]
    assert re.search(r"MLflow run: +\S+", demo.stdout), demo.stdout
    assert re.search(r"checkpoint: +\S+\n +sha256 [0-9a-f]{64}", demo.stdout), demo.stdout
    endpoint = re.search(r"endpoint: +(http://\S+)/invocations \(serving v1", demo.stdout)
    assert endpoint, demo.stdout
    answer = re.search(r"the model's own input example → (\[.*)", demo.stdout)
    assert answer and re.match(r"\[\s*-?\d", answer.group(1)), demo.stdout  # numbers: the regressor's predictions
    assert f"state:        {tmp_path / 'home'}" in demo.stdout  # everything under the given home
    url = endpoint.group(1)
    assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200  # still serving after make demo returned

    stop = subprocess.run(
        _make(stop_command),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stop.returncode == 0, (stop.stdout + stop.stderr)[-4000:]
    assert "stopped the demo's inference server" in stop.stdout, stop.stdout
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{url}/readyz", timeout=5)
        except httpx.TransportError:
            break  # nothing listens there any more
        assert time.monotonic() < deadline, f"{url} still answers after make demo-stop"
        time.sleep(1)
    again = subprocess.run(
        _make(stop_command),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0 and "no " in again.stdout and "server was running" in again.stdout, again.stdout
