"""Serve on this machine: ``LocalServing``, the embedded default serving backend.

It runs the server as a process on a free port: gpuferry's MLflow model server (``runtime/serve.py``) or the
workload's own (``serve.command`` of its ``gpuferry.yaml``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from blocks.base.backoff import Poll
from blocks.base.compute import inherited_environment
from blocks.base.proc import alive, free_port, start_time, stop
from blocks.base.serving import (
    Release,
    ServingBackend,
    file_tail,
    is_ready,
    require_smoke_request,
    smoke_test,
)
from blocks.checks import CheckRow, Probe, executable, writable_dir
from blocks.errors import ConfigurationError, DeployFailed
from blocks.home import gpuferry_home
from blocks.records import Endpoint
from blocks.specs import ServingSpec
from runtime import contract

# The directory that holds the `runtime` package (gpuferry's model server), for a local server's PYTHONPATH.
RUNTIME_PARENT = Path(contract.__file__).resolve().parent.parent


class LocalServing(ServingBackend):
    """Runs the inference server as a process on this machine, one per service."""

    _block_type_name = "gpuferry Local Serving"
    _description = (
        "Serves the model as a local process on a free port (gpuferry's MLflow model server, or the workload's own)."
    )

    python: str = Field(
        default_factory=lambda: sys.executable,
        description="Interpreter of gpuferry's model server, and of a leading `python` in the workload's server command.",  # noqa: E501 - part of the saved schema
    )
    host: str = Field("127.0.0.1", description="Address the server listens on.")
    state_dir: str | None = Field(None, description="Where service state and logs live (None: $GPUFERRY_HOME/serving).")
    drain_seconds: float = Field(30, gt=0, description="How long the old version may take to drain before SIGKILL.")
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of this process the server gets besides the contract's (the stack's store gives the "
        "credentials an s3:// model needs); nothing else of this environment reaches it.",
    )

    def _dir(self) -> Path:
        path = Path(self.state_dir) if self.state_dir else gpuferry_home() / "serving"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def validate(self, spec: ServingSpec) -> None:  # type: ignore[override]  # pydantic v1's BaseModel.validate, unused
        if spec.mig_profile:
            raise ConfigurationError(
                f"mig_profile={spec.mig_profile!r}: local serving cannot pin a MIG slice; use a Kubernetes stack"
            )
        if spec.replicas != 1:
            raise ConfigurationError(f"replicas={spec.replicas}: local serving runs one replica; set replicas=1")
        if spec.gpu_devices:
            raise ConfigurationError(
                f"gpu_devices={spec.gpu_devices}: local serving does not choose GPUs; use a "
                "Docker stack to name GPUs by index or UUID"
            )

    def preflight(self, spec: ServingSpec) -> None:
        """``validate``, and the server's interpreter must exist."""
        self.validate(spec)
        if shutil.which(self.python) is None:
            raise ConfigurationError(
                f"python={self.python!r}: no such executable here; set the block's python to an interpreter "
                "that has the workload's packages"
            )

    def services(self) -> list[str]:
        return sorted(p.stem for p in self._dir().glob("*.json") if self.current(p.stem) is not None)

    def current(self, service: str) -> dict[str, Any] | None:
        try:
            state = json.loads((self._dir() / f"{service}.json").read_text())
        except FileNotFoundError:
            return None
        return state if alive(state["pid"], state["pid_start"]) else None

    def deploy(self, spec: ServingSpec, release: Release) -> Endpoint:
        self.validate(spec)
        service = spec.service
        previous = self.current(service)
        if (
            previous
            and previous["version"] == release.version
            and previous["model_uri"] == release.model_uri
            and is_ready(previous["url"], previous.get("readiness_path", "/readyz"))
        ):
            return self._endpoint(spec, release, previous, previous_version=previous["version"], changed=False)
        smoke = require_smoke_request(spec)

        server = release.server
        port = free_port(self.host)
        log_path = self._dir() / f"{service}-v{release.version}-{port}.log"
        env = inherited_environment(self.pass_env)
        env.update({key: value.get_secret_value() for key, value in release.store_env.items()})
        env.update(server.env)
        env.update(
            {
                contract.MODEL_URI: release.model_uri,
                contract.HOST: self.host,
                contract.PORT: str(port),
                contract.MAX_BATCH_SIZE: str(spec.max_batch_size),
                contract.MAX_BATCH_WAIT_MS: str(spec.max_batch_wait_ms),
                contract.MAX_QUEUE: str(spec.max_queue),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if release.checkpoint_sha256:
            env[contract.MODEL_SHA256] = release.checkpoint_sha256
        env.setdefault(contract.MODEL_DEVICE, spec.device)  # pass_env may bring another
        if spec.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU service takes no GPU memory, on a GPU machine too
        if server.mlflow_server:
            argv, cwd = [self.python, str(RUNTIME_PARENT / "runtime" / "serve.py")], str(RUNTIME_PARENT)
            env["PYTHONPATH"] = str(RUNTIME_PARENT)
        else:
            assert server.command is not None
            argv = [self.python, *server.command[1:]] if server.command[0] == "python" else list(server.command)
            cwd = server.workdir or str(RUNTIME_PARENT)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        state: dict[str, Any] = {
            "pid": proc.pid,
            "pid_start": start_time(proc.pid),
            "url": f"http://{self.host}:{port}",
            "version": release.version,
            "model_uri": release.model_uri,
            "model_name": release.model_name,
            "readiness_path": server.readiness_path,
            "log": str(log_path),
            "started": time.time(),
        }
        try:
            self._wait_ready(state, spec.ready_timeout_seconds)
            smoke_test(state["url"], server, smoke)
        except BaseException:
            stop(state["pid"], state["pid_start"], grace_seconds=5)
            raise
        tmp = self._dir() / f".{service}.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._dir() / f"{service}.json")  # traffic now goes to the new version
        if previous:
            stop(previous["pid"], previous["pid_start"], grace_seconds=self.drain_seconds)
        return self._endpoint(spec, release, state, previous_version=previous["version"] if previous else None)

    def undeploy(self, service: str) -> bool:
        state = self.current(service)
        (self._dir() / f"{service}.json").unlink(missing_ok=True)
        return state is not None and stop(state["pid"], state["pid_start"], grace_seconds=self.drain_seconds)

    def _wait_ready(self, state: dict[str, Any], timeout: float) -> None:
        poll = Poll(0.1, 1.0, timeout=timeout)
        while not poll.expired():
            if not alive(state["pid"], state["pid_start"]):
                raise DeployFailed(
                    f"the server for version {state['version']} exited before it was ready; "
                    f"last lines of {state['log']}:\n{file_tail(state['log'])}"
                )
            if is_ready(state["url"], state["readiness_path"]):
                return
            poll.wait()
        raise DeployFailed(
            f"version {state['version']} was not ready within {timeout:.0f} s (ready_timeout_seconds); "
            f"last lines of {state['log']}:\n{file_tail(state['log'])}"
        )

    def _endpoint(
        self,
        spec: ServingSpec,
        release: Release,
        state: dict[str, Any],
        previous_version: str | None,
        changed: bool = True,
    ) -> Endpoint:
        return Endpoint(
            service=spec.service,
            url=spec.url or state["url"],
            model_version=release.version,
            backend=self.get_block_type_slug(),
            previous_version=previous_version,
            detail={"pid": state["pid"], "log": state["log"], "changed": changed},
        )

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The server's interpreter and the state directory."""
        probe.step(
            "python", lambda: executable(self.python), "set python to an interpreter with the workload's packages"
        )
        probe.step(
            "state directory",
            lambda: writable_dir(self.state_dir or str(gpuferry_home() / "serving")),
            "set state_dir to a writable directory",
        )
        return probe.rows
