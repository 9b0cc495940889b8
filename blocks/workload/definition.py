"""The workload definition: one YAML file (``gpuferry.yaml``) at the root of the user's repository.

It says everything gpuferry needs to run someone else's code, and nothing about any cluster:

.. code-block:: yaml

    name: house-prices                  # model name, experiment and service name unless the run says otherwise
    image:                              # how the image is made (one of three; leave out for image-less runs)
      dockerfile: Dockerfile            #   a Dockerfile and build context (relative to the root), or
      # base: python:3.11-slim          #   a base image + a pip requirements file: the Dockerfile is generated, or
      # requirements: requirements.txt
      # prebuilt: registry.example/team/img@sha256:...   # an image pinned by digest: nothing is built
    environment:
      python: /shared/envs/ml/bin/python   # `python` of the commands where there is no image (default: the backend's)
    train:
      command: [python, train.py]       # an argv list, run from the workload's root (no shell)
      env: {OMP_NUM_THREADS: "4"}
      secrets: {HF_TOKEN: hf-token}     # variable -> name of a Prefect Secret block (never a value here)
      resources: {gpus_per_node: 1, time_limit_minutes: 120}
      schedule: {cron: "0 3 * * 1", timezone: UTC}   # retrain by itself (its retrain deployment's schedule)
    hyperparameters:                    # a JSON Schema: types, defaults, bounds, enums, required
      type: object
      properties:
        alpha: {type: number, exclusiveMinimum: 0, default: 0.1}
    promotion: {metric: rmse, direction: minimize}
    serve:                              # gpuferry's MLflow model server, unless `command` names your own
      input_example: {dataframe_split: {columns: [...], data: [[...]]}}

The training command gets the contract's variables (``runtime/contract.py``); it writes an MLflow model to
``$CHECKPOINT_DIR/final/``, which is what gets stored, registered and served. Pure: nothing here talks to
anything (``blocks/workload/source.py`` loads the file from a path or a git URL).
"""

from __future__ import annotations

import posixpath
import re
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocks.specs import Resources, RolloutPolicy, ServingShape
from blocks.values import check_env_names, check_name, check_pinned_image
from blocks.workload.hparams import HyperparameterSchema

WORKLOAD_FILE = "gpuferry.yaml"
_BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_HTTP_PATH = re.compile(r"^/[A-Za-z0-9_./~-]{0,255}$")
_RELATIVE = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.(?:/|$))[A-Za-z0-9_./@+-]{1,255}$")
# What gpuferry's own model server answers on (runtime/serve.py).
MLFLOW_SERVER_PORT = 8080
MLFLOW_SERVER_PATHS = {"health_path": "/healthz", "readiness_path": "/readyz", "prediction_path": "/invocations"}


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _argv(value: list[str], field: str) -> list[str]:
    if not value or not all(isinstance(a, str) and a and "\x00" not in a for a in value):
        raise ValueError(f"{field} must be a non-empty list of non-empty strings (an argv list, no shell)")
    return value


def _env(value: dict[str, str], field: str) -> dict[str, str]:
    check_env_names(value, field)
    return value


def _relative(value: str | None, field: str) -> str | None:
    if value is not None and not _RELATIVE.match(value):
        raise ValueError(f"{field}={value!r} must be a path relative to the workload's root, inside it (no '..')")
    return value


class ImageDefinition(_Part):
    """How the workload's image is made: exactly one of ``dockerfile``, ``base`` (+ ``requirements``), ``prebuilt``."""

    dockerfile: str | None = Field(None, description="Dockerfile, relative to the build context.")
    context: str = Field(".", description="Build context, relative to the workload's root.")
    base: str | None = Field(None, description="Base image of a generated Dockerfile (python and pip in it).")
    requirements: str | None = Field(None, description="pip requirements file of a generated Dockerfile.")
    prebuilt: str | None = Field(None, description="An image pinned by digest (repo@sha256:...): nothing is built.")
    build_args: dict[str, str] = Field(default_factory=dict, description="Build arguments (ARG) of the Dockerfile.")
    workdir: str | None = Field(
        None,
        description="Where the code is inside the image; the commands run there (default: the Dockerfile's "
        "last WORKDIR; /workload for a generated Dockerfile).",
    )

    @field_validator("dockerfile", "requirements")
    @classmethod
    def _inside(cls, value: str | None, info: Any) -> str | None:
        return _relative(value, f"image.{info.field_name}")

    @field_validator("context")
    @classmethod
    def _context(cls, value: str) -> str:
        return value if value == "." else _relative(value, "image.context")  # type: ignore[return-value]

    @field_validator("prebuilt")
    @classmethod
    def _pinned(cls, value: str | None) -> str | None:
        return None if value is None else check_pinned_image(value, "image.prebuilt")

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^/[A-Za-z0-9_./-]{0,255}$", value):
            raise ValueError(f"image.workdir={value!r} must be an absolute path inside the image")
        return value

    @field_validator("build_args")
    @classmethod
    def _args(cls, value: dict[str, str]) -> dict[str, str]:
        return _env(value, "image.build_args")

    @model_validator(mode="after")
    def _one_way(self) -> ImageDefinition:
        given = [name for name in ("dockerfile", "base", "prebuilt") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of image.dockerfile (your Dockerfile), image.base (+ image.requirements: the "
                f"Dockerfile is generated) or image.prebuilt (an image pinned by digest); got {given or 'none'}"
            )
        if self.requirements and not self.base:
            raise ValueError("image.requirements goes with image.base (a generated Dockerfile installs it)")
        return self

    @property
    def kind(self) -> Literal["dockerfile", "generated", "prebuilt"]:
        return "dockerfile" if self.dockerfile else "generated" if self.base else "prebuilt"


class EnvironmentDefinition(_Part):
    """The interpreter on a cluster without containers."""

    python: str | None = Field(
        None,
        description="Runs the commands' leading `python` where there is no image (e.g. a venv's bin/python "
        "on the cluster's shared filesystem). None: the compute backend's interpreter.",
    )

    @field_validator("python")
    @classmethod
    def _python(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9_./+-]{1,255}$", value):
            raise ValueError(f"environment.python={value!r}: a path or command name without spaces")
        return value


class ScheduleDefinition(_Part):
    """When the workload retrains by itself: its ``retrain/<name>`` deployment runs on this schedule."""

    cron: str = Field(description="A cron line: minute hour day-of-month month day-of-week, e.g. '0 3 * * 1'.")
    timezone: str = Field("UTC", description="The IANA time zone the cron line is read in, e.g. Europe/Berlin.")

    @model_validator(mode="after")
    def _valid(self) -> ScheduleDefinition:
        from prefect.client.schemas.schedules import CronSchedule
        from pydantic import ValidationError

        try:
            CronSchedule(cron=self.cron, timezone=self.timezone)
        except ValidationError as exc:
            problem = exc.errors()[0]
            field = problem["loc"][0] if problem["loc"] else "cron"
            raise ValueError(
                f"train.schedule.{field}={getattr(self, str(field))!r}: "
                + (
                    "write five fields, minute hour day-of-month month day-of-week, e.g. '0 3 * * 1'"
                    if field == "cron"
                    else "give an IANA time zone, e.g. UTC or Europe/Berlin"
                )
            ) from None
        return self


class TrainDefinition(_Part):
    """The training job."""

    command: list[str] = Field(description="argv of the training job, run from the workload's root (no shell).")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the job (no secrets).")
    secrets: dict[str, str] = Field(
        default_factory=dict, description="Variable name -> name of the Prefect Secret block that holds its value."
    )
    resources: Resources = Field(default_factory=Resources, description="Default resources of one training job.")
    checkpoint_every: int = Field(50, ge=1, description="CHECKPOINT_EVERY: steps between checkpoints.")
    schedule: ScheduleDefinition | None = Field(
        None,
        description="When the workload retrains by itself (None: only when asked): `gpuferry deploy --workload` "
        "gives its retrain deployment this schedule; `--cron` overrides it.",
    )

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        return _argv(value, "train.command")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _env(value, "train.env")

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: dict[str, str]) -> dict[str, str]:
        _env(value, "train.secrets")
        for env, block in value.items():
            if not _BLOCK_NAME.match(block):
                raise ValueError(
                    f"train.secrets[{env!r}]={block!r} must name a Prefect Secret block (lowercase letters, digits "
                    "and '-'); put the value in the block, never in this file"
                )
        return value


class PromotionDefinition(_Part):
    """Which logged metric decides whether a new version beats the champion."""

    metric: str = Field(description="A metric the training job logs to MLflow.")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Which way is better.")


class ServeDefinition(ServingShape):
    """How the model is served: gpuferry's MLflow model server, or the workload's own (``command``), and the
    service's shape (``ServingShape``: replicas, GPUs, CPU and memory, its URL), which the model version records."""

    service_name: str | None = Field(None, description="Name of the service (None: the workload's name).")
    command: list[str] | None = Field(
        None,
        description="argv of your own inference server (None: gpuferry's server for MLflow models).",
    )
    port: int = Field(
        MLFLOW_SERVER_PORT, ge=1, le=65535, description="Port your server listens on (PORT is set to it)."
    )
    health_path: str = Field(MLFLOW_SERVER_PATHS["health_path"], description="Liveness path of your server.")
    readiness_path: str = Field(MLFLOW_SERVER_PATHS["readiness_path"], description="Readiness path of your server.")
    prediction_path: str = Field(MLFLOW_SERVER_PATHS["prediction_path"], description="Path the smoke request goes to.")
    input_example: dict[str, Any] | None = Field(
        None,
        description="The smoke request (a JSON body) when the model carries no serving input example.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the server (no secrets).")
    rollout: RolloutPolicy = Field(
        default_factory=RolloutPolicy,
        description="How a new version takes over the service: rolling (at once, once ready), or canary or shadow "
        "(judged by live traffic against the version serving; the alias moves only when it passes).",
    )

    @field_validator("service_name")
    @classmethod
    def _service(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "serve.service_name")

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _argv(value, "serve.command")

    @field_validator("health_path", "readiness_path", "prediction_path")
    @classmethod
    def _paths(cls, value: str, info: Any) -> str:
        if not _HTTP_PATH.match(value):
            raise ValueError(f"serve.{info.field_name}={value!r} must be an HTTP path such as /healthz")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _env(value, "serve.env")

    @model_validator(mode="after")
    def _own_server_only(self) -> ServeDefinition:
        if self.command is None:
            changed = [k for k, v in MLFLOW_SERVER_PATHS.items() if getattr(self, k) != v]
            if self.port != MLFLOW_SERVER_PORT:
                changed.append("port")
            if changed:
                raise ValueError(
                    f"serve.{', serve.'.join(changed)} describe your own server: set serve.command too, or leave them "
                    "out to serve the MLflow model with gpuferry's server"
                )
        return self

    @property
    def mlflow_server(self) -> bool:
        return self.command is None


class WorkloadDefinition(_Part):
    """The contents of ``gpuferry.yaml``."""

    name: str = Field(description="The workload's name: registered model, experiment and service unless overridden.")
    description: str = Field("", description="What the workload trains.")
    image: ImageDefinition | None = Field(None, description="How the image is made (None: runs without one only).")
    environment: EnvironmentDefinition = Field(default_factory=EnvironmentDefinition)
    train: TrainDefinition
    hyperparameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the hyperparameters (the job reads them as JSON from HPARAMS).",
    )
    promotion: PromotionDefinition
    serve: ServeDefinition = Field(default_factory=ServeDefinition)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, "name")

    @model_validator(mode="after")
    def _schema_ok(self) -> WorkloadDefinition:
        HyperparameterSchema(self.hyperparameters)  # a bad schema is a bad file
        return self

    @cached_property
    def schema(self) -> HyperparameterSchema:  # type: ignore[override]  # BaseModel.schema is pydantic v1's, unused
        return HyperparameterSchema(self.hyperparameters)

    @property
    def service_name(self) -> str:
        return self.serve.service_name or self.name

    def image_workdir(self, dockerfile_text: str | None = None) -> str | None:
        """Where the commands run inside the image: declared, /workload for a generated Dockerfile, else the
        last WORKDIR of the Dockerfile's final stage (None: the image's own)."""
        image = self.image
        if image is None:
            return None
        if image.workdir:
            return image.workdir
        if image.kind == "generated":
            return GENERATED_WORKDIR
        return last_workdir(dockerfile_text) if dockerfile_text else None


GENERATED_WORKDIR = "/workload"


def last_workdir(dockerfile: str) -> str | None:
    """The working directory the final stage of ``dockerfile`` ends in (relative WORKDIRs resolved), or None."""
    current: str | None = None
    for raw in dockerfile.splitlines():
        words = raw.strip().split(None, 1)
        if not words:
            continue
        instruction = words[0].upper()
        if instruction == "FROM":
            current = None
        elif instruction == "WORKDIR" and len(words) == 2:
            target = words[1].strip().strip('"')
            if "$" in target:
                return None  # an ARG/ENV in it: not known before the build; declare image.workdir
            current = posixpath.normpath(posixpath.join(current or "/", target))
    return current
