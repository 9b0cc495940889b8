"""The serving step's interface: where the inference service runs.

``ServingBackend.deploy(spec, release)`` brings up the new model version, checks it (ready, then a
smoke prediction) and only then moves traffic to it and retires the previous version. A version that
fails its checks never receives traffic and the previous one keeps serving. Deploying the version
that already serves changes nothing. ``preflight(spec)`` makes the read-only checks against the
backend that a pipeline runs before it acquires nodes or trains, so that a long training does not end
in a service that cannot be scheduled.

``DeployOutcome`` is what a deploy ended with (deployed, rolled back and why, or failed and why), as
the pipeline records it in MLflow and in the deploy step's Prefect artifact. The smoke request (the model's own
serving input example) and how it is sent are here too: every backend gates its deploys the same way.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks.base.images import RUNTIME_IN_IMAGE
from blocks.checks import CheckRow, Probe
from blocks.errors import CanaryFailed, ConfigurationError, DeployFailed, RolledBack
from blocks.records import Endpoint, ImageRef, ServerSpec
from blocks.specs import ServingSpec
from blocks.values import check_pinned_image

# gpuferry's model server as every backend starts it in an image: its file, not `-m runtime.serve`, so that a
# workload's own `runtime.py` in the image's working directory cannot shadow the package (runtime/serve.py puts
# gpuferry's root first and the working directory last). LocalServing runs the same file of this installation.
SERVER_COMMAND = ("python", f"{RUNTIME_IN_IMAGE}/runtime/serve.py")


class Release(BaseModel):
    """The model version to serve."""

    model_config = ConfigDict(frozen=True)

    model_name: str
    version: str
    model_uri: str
    image: ImageRef | None = None
    server: ServerSpec = Field(default_factory=ServerSpec, description="What serves it (the workload's serve section).")
    checkpoint_sha256: str | None = Field(
        None, description="The stored checkpoint's identity, as the version records it."
    )
    store_env: dict[str, SecretStr] = Field(
        default_factory=dict, description="What the server needs to read the checkpoint (the store's credentials)."
    )


class DeployOutcome(BaseModel):
    """What one deploy ended with: the release serves, or it was rolled back (and why), or it failed (and why)."""

    model_config = ConfigDict(frozen=True)

    TAG_PREFIX: ClassVar[str] = "deploy."
    MAX_TEXT: ClassVar[int] = 4000  # MLflow run tags hold 8000 characters; a rollout's message stays well below

    status: Literal["deployed", "rolled_back", "canary_failed", "failed"]
    model_name: str
    version: str = Field(description="The version the deploy tried to serve.")
    endpoint: str | None = None
    backend: str | None = None
    previous_version: str | None = Field(None, description="The version that served before (deployed).")
    rolled_back_to: str | None = Field(None, description="The version that serves again after the rollback.")
    reason: str | None = Field(None, description="Why it did not deploy: a rollout reason or the error's first line.")
    message: str | None = Field(None, description="The whole error message.")
    rollout: dict[str, Any] = Field(
        default_factory=dict,
        description="A canary or shadow rollout's strategy and what its window measured (error rates, p99 "
        "latencies, agreement).",
    )

    @classmethod
    def deployed(cls, release: Release, endpoint: Endpoint) -> DeployOutcome:
        return cls(
            status="deployed",
            model_name=release.model_name,
            version=release.version,
            endpoint=endpoint.url,
            backend=endpoint.backend,
            previous_version=endpoint.previous_version,
            rollout=endpoint.detail.get("rollout") or {},
        )

    @classmethod
    def from_error(cls, release: Release, exc: BaseException) -> DeployOutcome:
        """The outcome of a deploy that raised ``exc``: rolled back (``RolledBack``) or failed (anything else)."""
        text = str(exc) or type(exc).__name__
        message = text if len(text) <= cls.MAX_TEXT else text[: cls.MAX_TEXT - 1] + "…"
        if isinstance(exc, RolledBack):
            return cls(
                status="rolled_back",
                model_name=release.model_name,
                version=exc.failed_version,
                rolled_back_to=exc.rolled_back_to,
                reason=exc.reason,
                message=message,
            )
        if isinstance(exc, CanaryFailed):
            return cls(
                status="canary_failed",
                model_name=release.model_name,
                version=exc.version,
                rolled_back_to=exc.serving_version,
                reason="; ".join(exc.reasons),
                message=message,
                rollout=exc.numbers,
            )
        first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return cls(
            status="failed",
            model_name=release.model_name,
            version=release.version,
            reason=f"{type(exc).__name__}: {first_line[:500]}",
            message=message,
        )

    def tags(self) -> dict[str, str]:
        """The outcome as MLflow tags (``deploy.*``), the same on the run and on the model version."""
        fields = {
            "status": self.status,
            "version": self.version,
            "endpoint": self.endpoint,
            "backend": self.backend,
            "previous_version": self.previous_version,
            "rolled_back_to": self.rolled_back_to,
            "failed_version": self.version if self.status != "deployed" else None,
            "reason": self.reason,
            "message": self.message,
        }
        fields.update({f"rollout.{k}": f"{v:g}" if isinstance(v, float) else str(v) for k, v in self.rollout.items()})
        return {f"{self.TAG_PREFIX}{k}": v for k, v in fields.items() if v is not None}

    def markdown(self) -> str:
        """The outcome for the deploy step's Prefect artifact."""
        head = f"{self.model_name} v{self.version}"
        measured = "".join(f"\n| {k} | {v} |" for k, v in self.rollout.items())
        table = f"\n\n| measured | |\n|---|---|{measured}" if measured else ""
        if self.status == "deployed":
            previous = f" (replaced v{self.previous_version})" if self.previous_version else ""
            passed = f", after its {self.rollout.get('strategy')} passed" if self.rollout else ""
            return f"**{head}** serves at {self.endpoint}{previous}{passed}{table}"
        if self.status == "rolled_back":
            summary = f"**{head} rolled back** ({self.reason}): v{self.rolled_back_to} serves again"
        elif self.status == "canary_failed":
            summary = (
                f"**{head} failed its {self.rollout.get('strategy', 'canary')}** ({self.reason}): removed, "
                f"v{self.rolled_back_to} serves every request{table}"
            )
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


def release_image(reference: str | None, backend: str) -> str:
    """The image a serving backend runs a release in: there is one, and it is pinned by digest (a tag can move
    between a rollout and its rollback)."""
    if not reference:
        raise ConfigurationError(
            f"{backend} needs an image: the release has none (the stack's image builder made no image). "
            "Use an image builder that builds and pushes one, or deploy with a LocalServing stack"
        )
    return check_pinned_image(reference, "release.image.reference")


class ServingBackend(Block, ABC):
    """Where the inference service runs."""

    _block_type_name = "gpuferry Serving Backend"
    # Whether this backend runs the release's container image (then the stack must build one).
    needs_image: ClassVar[bool] = False

    @abstractmethod
    def self_check(self, probe: Probe) -> list[CheckRow]:
        """What ``gpuferry check`` reports of this backend: each check a row of ``probe`` (``blocks/checks.py``). It
        only reads, or writes a probe object and deletes it; ``Stack.check`` runs it with a deadline."""

    @abstractmethod
    def validate(self, spec: ServingSpec) -> None:  # type: ignore[override]  # pydantic v1's BaseModel.validate, unused
        """Raise ``ConfigurationError`` when this backend cannot serve ``spec`` (no side effect)."""

    # How a new version may take over (RolloutPolicy.strategy): a backend that judges one by live traffic adds
    # "canary" or "shadow".
    rollout_strategies: ClassVar[tuple[str, ...]] = ("rolling",)

    def rollout_status(self, service: str) -> dict[str, Any] | None:
        """The canary or shadow window under way for ``service`` (None: none); a backend that judges no rollout
        has none."""
        return None

    def decide_rollout(self, service: str, decision: str) -> None:
        """End the window under way for ``service`` by hand: ``promote`` or ``abort``."""
        raise ConfigurationError(f"{type(self).__name__} judges no rollout by live traffic: nothing to {decision}")

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

    @abstractmethod
    def services(self) -> list[str]:
        """The services gpuferry serves on this backend now (what ``current`` takes), sorted."""


def is_ready(url: str, path: str = "/readyz") -> bool:
    try:
        return httpx.get(f"{url}{path}", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def file_tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
