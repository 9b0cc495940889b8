"""DockerServing's wait for a new container, against an engine that answers as podman does under a restart policy."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prefect_docker.host import DockerHost

from blocks.docker import serving as docker_serving
from blocks.docker.serving import DockerServing
from blocks.errors import DeployFailed


class Answers:
    """``inspect`` answers one after the other (the last one again once they run out)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers: Iterator[dict[str, Any]] = iter(answers)
        self.last = answers[-1]
        self.calls = 0

    def inspect(self, name: str) -> dict[str, Any]:
        self.calls += 1
        self.last = next(self.answers, self.last)
        return self.last


def state(status: str, exit_code: int, restarts: int) -> dict[str, Any]:
    return {"State": {"Status": status, "ExitCode": exit_code, "OOMKilled": False}, "RestartCount": restarts}


RELEASE = SimpleNamespace(version="2", server=SimpleNamespace(readiness_path="/readyz"))


def wait(monkeypatch: pytest.MonkeyPatch, engine: Answers) -> str:
    monkeypatch.setattr(DockerServing, "engine", lambda self: engine)
    block = DockerServing(docker_host=DockerHost(base_url="unix:///nonexistent.sock"))
    with pytest.raises(DeployFailed) as failed:
        block._wait_ready("candidate", RELEASE, timeout=60)  # type: ignore[arg-type]
    return str(failed.value)


def test_a_restarted_server_is_reported_with_the_exit_code_of_its_failed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen first just after the restart policy started it again (exit code 0 of the new run), then exited.
    engine = Answers([state("running", 0, 1), state("running", 0, 1), state("restarting", 127, 2)])
    assert "exited (exit code 127) before it was ready" in wait(monkeypatch, engine)
    assert engine.calls == 3


@pytest.mark.parametrize("code", [2, 0])
def test_an_exit_is_reported_at_once(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    engine = Answers([state("exited", code, 0)])
    assert f"exited (exit code {code}) before it was ready" in wait(monkeypatch, engine)
    assert engine.calls == 1


def test_a_restart_whose_exit_code_never_shows_fails_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_serving, "RESTARTED_EXIT_WAIT_S", 0.5)
    message = wait(monkeypatch, Answers([state("running", 0, 1)]))
    assert "exited (restarted 1x, exit code not seen) before it was ready" in message
