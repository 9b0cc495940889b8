"""Serving backends: where the inference service runs.

``ServingBackend.deploy(spec, release)`` brings up the new model version, checks it (ready, then a
smoke prediction) and only then moves traffic to it and retires the previous version. A version that
fails its checks never receives traffic and the previous one keeps serving. Deploying the version
that already serves changes nothing. ``preflight(spec)`` makes the read-only checks against the
backend that a pipeline runs before it acquires nodes or trains, so that a long training does not end
in a service that cannot be scheduled.

``DeployOutcome`` is what a deploy ended with (deployed, rolled back and why, or failed and why), as
the pipeline records it in MLflow and in the deploy step's Prefect artifact.

The embedded default, ``LocalServing``, runs the server as a process on a free port: gpuferry's MLflow
model server (``runtime/serve.py``) or the workload's own (``serve.command`` of its ``gpuferry.yaml``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks._proc import alive, free_port, start_time, stop
from blocks.backoff import Poll
from blocks.checks import CheckRow, Probe, executable, writable_dir
from blocks.compute import inherited_environment
from blocks.errors import ConfigurationError, DeployFailed, RolledBack
from blocks.home import gpuferry_home
from blocks.specs import Endpoint, ImageRef, ServerSpec, ServingSpec
from runtime import contract

# The directory that holds the `runtime` package (gpuferry's model server), for a local server's PYTHONPATH.
RUNTIME_PARENT = Path(contract.__file__).resolve().parent.parent


class Release(BaseModel):
    """The model version to serve."""

    model_config = ConfigDict(frozen=True)

    model_name: str
    version: str
    model_uri: str
    image: ImageRef | None = None
    server: ServerSpec = Field(default_factory=ServerSpec, description="What serves it (the workload's serve section).")
    checkpoint_sha256: str | None = Field(None, description="The stored checkpoint's identity, as the version records it.")
    store_env: dict[str, SecretStr] = Field(
        default_factory=dict, description="What the server needs to read the checkpoint (the store's credentials)."
    )


class DeployOutcome(BaseModel):
    """What one deploy ended with: the release serves, or it was rolled back (and why), or it failed (and why)."""

    model_config = ConfigDict(frozen=True)

    TAG_PREFIX: ClassVar[str] = "deploy."
    MAX_TEXT: ClassVar[int] = 4000  # MLflow run tags hold 8000 characters; a rollout's message stays well below

    status: Literal["deployed", "rolled_back", "failed"]
    model_name: str
    version: str = Field(description="The version the deploy tried to serve.")
    endpoint: str | None = None
    backend: str | None = None
    previous_version: str | None = Field(None, description="The version that served before (deployed).")
    rolled_back_to: str | None = Field(None, description="The version that serves again after the rollback.")
    reason: str | None = Field(None, description="Why it did not deploy: a rollout reason or the error's first line.")
    message: str | None = Field(None, description="The whole error message.")

    @classmethod
    def deployed(cls, release: Release, endpoint: Endpoint) -> DeployOutcome:
        return cls(
            status="deployed", model_name=release.model_name, version=release.version, endpoint=endpoint.url,
            backend=endpoint.backend, previous_version=endpoint.previous_version,
        )  # fmt: skip

    @classmethod
    def from_error(cls, release: Release, exc: BaseException) -> DeployOutcome:
        """The outcome of a deploy that raised ``exc``: rolled back (``RolledBack``) or failed (anything else)."""
        text = str(exc) or type(exc).__name__
        message = text if len(text) <= cls.MAX_TEXT else text[: cls.MAX_TEXT - 1] + "…"
        if isinstance(exc, RolledBack):
            return cls(
                status="rolled_back", model_name=release.model_name, version=exc.failed_version,
                rolled_back_to=exc.rolled_back_to, reason=exc.reason, message=message,
            )  # fmt: skip
        first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return cls(
            status="failed", model_name=release.model_name, version=release.version,
            reason=f"{type(exc).__name__}: {first_line[:500]}", message=message,
        )  # fmt: skip

    def tags(self) -> dict[str, str]:
        """The outcome as MLflow tags (``deploy.*``), the same on the run and on the model version."""
        fields = {
            "status": self.status, "version": self.version, "endpoint": self.endpoint, "backend": self.backend,
            "previous_version": self.previous_version, "rolled_back_to": self.rolled_back_to,
            "failed_version": self.version if self.status != "deployed" else None,
            "reason": self.reason, "message": self.message,
        }  # fmt: skip
        return {f"{self.TAG_PREFIX}{k}": v for k, v in fields.items() if v is not None}

    def markdown(self) -> str:
        """The outcome for the deploy step's Prefect artifact."""
        head = f"{self.model_name} v{self.version}"
        if self.status == "deployed":
            previous = f" (replaced v{self.previous_version})" if self.previous_version else ""
            return f"**{head}** serves at {self.endpoint}{previous}"
        if self.status == "rolled_back":
            summary = f"**{head} rolled back** ({self.reason}): v{self.rolled_back_to} serves again"
        else:
            summary = f"**{head} not deployed**"
        return f"{summary}\n\n```\n{self.message}\n```"


def request_rows(request: dict[str, Any]) -> int | None:
    """How many rows an MLflow scoring request carries (None when its format does not say)."""
    for key in ("inputs", "instances"):
        value = request.get(key)
        if isinstance(value, list):
            return len(value)
        if isinstance(value, dict) and value:
            first = next(iter(value.values()))
            return len(first) if isinstance(first, list) else None
    split = request.get("dataframe_split")
    if isinstance(split, dict) and isinstance(split.get("data"), list):
        return len(split["data"])
    records = request.get("dataframe_records")
    return len(records) if isinstance(records, list) else None


# The smoke request's transport: (path, JSON body) -> (status code, parsed body: JSON, else the text).
SmokeSend = Callable[[str, dict[str, Any]], tuple[int, Any]]


def http_send(url: str, timeout: float = 30.0) -> SmokeSend:
    """POST straight to the server at ``url`` (a transport for ``smoke_check``)."""

    def send(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            response = httpx.post(f"{url}{path}", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise DeployFailed(f"smoke test: no answer from {url}{path}: {exc}") from exc
        return response.status_code, parsed_body(response)

    return send


def parsed_body(response: httpx.Response) -> Any:
    """The response's JSON, or its text when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return response.text


def require_smoke_request(spec: ServingSpec) -> dict[str, Any]:
    """The spec's smoke request; a backend's deploy never guesses one (the flow fills it in from the
    registered model's input example, or the user sets ``ServingSpec.smoke_request``)."""
    if spec.smoke_request is None:
        raise ConfigurationError(
            "ServingSpec.smoke_request is not set: the flow fills it in from the model's input example; "
            "when calling deploy yourself, set smoke_request to a request body the model answers"
        )
    return spec.smoke_request


def smoke_check(send: SmokeSend, server: ServerSpec, request: dict[str, Any]) -> Any:
    """Send the smoke request to the server's prediction path through ``send``: it must answer 200, and
    gpuferry's MLflow model server one prediction per row sent. Raises ``DeployFailed`` saying what was wrong."""
    status, body = send(server.prediction_path, request)
    if status != 200:
        text = body if isinstance(body, str) else json.dumps(body)
        raise DeployFailed(f"smoke test: {server.prediction_path} answered {status}: {text[:500]}")
    if server.mlflow_server:
        predictions = body.get("predictions") if isinstance(body, dict) else None
        if predictions is None:
            raise DeployFailed(f"smoke test: the answer has no predictions: {str(body)[:500]}")
        rows = request_rows(request)
        if rows is not None and hasattr(predictions, "__len__") and len(predictions) != rows:
            raise DeployFailed(f"smoke test: sent {rows} rows, got {len(predictions)} predictions")
    return body


def smoke_test(url: str, server: ServerSpec, request: dict[str, Any], timeout: float = 30.0) -> Any:
    """``smoke_check`` against the server at ``url``."""
    return smoke_check(http_send(url, timeout), server, request)


class ServingBackend(Block, ABC):
    """Where the inference service runs."""

    _block_type_name = "gpuferry Serving Backend"
    # Whether this backend runs the release's container image (then the stack must build one).
    needs_image: ClassVar[bool] = False

    @abstractmethod
    def validate(self, spec: ServingSpec) -> None:
        """Raise ``ConfigurationError`` when this backend cannot serve ``spec`` (no side effect)."""

    def preflight(self, spec: ServingSpec) -> None:
        """Read-only checks against the backend itself (``validate``, then what needs a call), run before a
        pipeline acquires nodes or trains. Raise ``ConfigurationError`` when ``spec`` cannot be served there."""
        self.validate(spec)

    @abstractmethod
    def deploy(self, spec: ServingSpec, release: Release) -> Endpoint:
        """Serve ``release``; the previous version stops only after the new one is ready."""

    @abstractmethod
    def undeploy(self, service: str) -> bool:
        """Stop the service; True if something was running."""

    @abstractmethod
    def current(self, service: str) -> dict[str, Any] | None:
        """What serves ``service`` now (version, url, ...), or None."""


class LocalServing(ServingBackend):
    """Runs the inference server as a process on this machine, one per service."""

    _block_type_name = "gpuferry Local Serving"
    _description = "Serves the model as a local process on a free port (gpuferry's MLflow model server, or the workload's own)."

    python: str = Field(
        default_factory=lambda: sys.executable,
        description="Interpreter of gpuferry's model server, and of a leading `python` in the workload's server command.",
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

    def validate(self, spec: ServingSpec) -> None:
        if spec.mig_profile:
            raise ConfigurationError(
                f"mig_profile={spec.mig_profile!r}: local serving cannot pin a MIG slice; use a Kubernetes stack"
            )
        if spec.replicas != 1:
            raise ConfigurationError(f"replicas={spec.replicas}: local serving runs one replica; set replicas=1")
        if spec.gpu_devices:
            raise ConfigurationError(f"gpu_devices={spec.gpu_devices}: local serving does not choose GPUs; use a "
                                     "Docker stack to name GPUs by index or UUID")  # fmt: skip

    def preflight(self, spec: ServingSpec) -> None:
        """``validate``, and the server's interpreter must exist."""
        self.validate(spec)
        if shutil.which(self.python) is None:
            raise ConfigurationError(
                f"python={self.python!r}: no such executable here; set the block's python to an interpreter "
                "that has the workload's packages"
            )

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
        if previous and previous["version"] == release.version and previous["model_uri"] == release.model_uri:
            if _ready(previous["url"], previous.get("readiness_path", "/readyz")):
                return self._endpoint(spec, release, previous, previous_version=previous["version"], changed=False)
        require_smoke_request(spec)

        server = release.server
        port = free_port(self.host)
        log_path = self._dir() / f"{service}-v{release.version}-{port}.log"
        env = inherited_environment(self.pass_env)
        env.update({key: value.get_secret_value() for key, value in release.store_env.items()})
        env.update(server.env)
        env.update({
            contract.MODEL_URI: release.model_uri,
            contract.HOST: self.host,
            contract.PORT: str(port),
            contract.MAX_BATCH_SIZE: str(spec.max_batch_size),
            contract.MAX_BATCH_WAIT_MS: str(spec.max_batch_wait_ms),
            contract.MAX_QUEUE: str(spec.max_queue),
            "PYTHONUNBUFFERED": "1",
        })  # fmt: skip
        if release.checkpoint_sha256:
            env[contract.MODEL_SHA256] = release.checkpoint_sha256
        if not spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if server.mlflow_server:
            argv, cwd = [self.python, "-m", "runtime.serve"], str(RUNTIME_PARENT)
            env["PYTHONPATH"] = str(RUNTIME_PARENT)
        else:
            assert server.command is not None
            argv = [self.python, *server.command[1:]] if server.command[0] == "python" else list(server.command)
            cwd = server.workdir or str(RUNTIME_PARENT)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        state = {
            "pid": proc.pid, "pid_start": start_time(proc.pid), "url": f"http://{self.host}:{port}",
            "version": release.version, "model_uri": release.model_uri, "model_name": release.model_name,
            "readiness_path": server.readiness_path, "log": str(log_path), "started": time.time(),
        }  # fmt: skip
        try:
            self._wait_ready(state, spec.ready_timeout_seconds)
            smoke_test(state["url"], server, spec.smoke_request)
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
        return bool(state) and stop(state["pid"], state["pid_start"], grace_seconds=self.drain_seconds)

    def _wait_ready(self, state: dict[str, Any], timeout: float) -> None:
        poll = Poll(0.1, 1.0, timeout=timeout)
        while not poll.expired():
            if not alive(state["pid"], state["pid_start"]):
                raise DeployFailed(
                    f"the server for version {state['version']} exited before it was ready; "
                    f"last lines of {state['log']}:\n{_tail(state['log'])}"
                )
            if _ready(state["url"], state["readiness_path"]):
                return
            poll.wait()
        raise DeployFailed(
            f"version {state['version']} was not ready within {timeout:.0f} s (ready_timeout_seconds); "
            f"last lines of {state['log']}:\n{_tail(state['log'])}"
        )

    def _endpoint(
        self, spec: ServingSpec, release: Release, state: dict[str, Any], previous_version: str | None, changed: bool = True
    ) -> Endpoint:
        return Endpoint(
            service=spec.service,
            url=state["url"],
            model_version=release.version,
            backend=self.get_block_type_slug(),
            previous_version=previous_version,
            detail={"pid": state["pid"], "log": state["log"], "changed": changed},
        )

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The server's interpreter and the state directory."""
        probe.step("python", lambda: executable(self.python),
                   "set python to an interpreter with the workload's packages")
        probe.step("state directory", lambda: writable_dir(self.state_dir or str(gpuferry_home() / "serving")),
                   "set state_dir to a writable directory")
        return probe.rows


def _ready(url: str, path: str = "/readyz") -> bool:
    try:
        return httpx.get(f"{url}{path}", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
