"""One run's settings: the flow's parameters over the workload's definition, checked before anything runs.

A flow run says what it wants (``TrainingSpec``, ``ServingSpec``, ``PromotionPolicy``); whatever it leaves
empty comes from the workload's ``gpuferry.yaml``: the experiment and model name, the resources, the
hyperparameters' defaults, the promotion metric, the service name and the server. ``plan_run`` merges the
two and validates the hyperparameters against the workload's JSON Schema, so a typo or a bad value stops
the run before a node is acquired. Pure: no outside calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr

from blocks.mlflow_model import ModelInfo, NoModel
from blocks.secrets import check_job_secrets
from blocks.specs import ImageRef, PromotionPolicy, Resources, ServerSpec, ServingSpec, TrainingJob, TrainingSpec
from blocks.workload import Workload
from runtime import contract

# Model version tags that say how a version is served (deploy-model reads them back).
TAG_PREFIX = "gpuferry."
SERVICE_TAG = "gpuferry.service"
SERVER_TAG = "gpuferry.server"
IMAGE_TAG = "gpuferry.image"
IMAGE_WORKDIR_TAG = "gpuferry.image.workdir"
INPUT_EXAMPLE_TAG = "gpuferry.input_example"
MAX_TAG_CHARS = 4000  # a model version tag holds 5000 characters


class RunPlan(BaseModel):
    """The settings one training run uses, every default filled in."""

    model_config = ConfigDict(frozen=True)

    workload: Workload
    experiment: str
    model_name: str
    hyperparameters: dict[str, Any]
    resources: Resources
    checkpoint_every: int
    promotion: PromotionPolicy
    serving: ServingSpec
    server: ServerSpec

    def job(self, key: str, workdir: str, image: ImageRef | None, env: dict[str, str],
            secret_env: Mapping[str, SecretStr] | None = None) -> TrainingJob:  # fmt: skip
        """The training job of this plan (``env``: what the pipeline adds, e.g. the MLflow run; ``secret_env``:
        the secrets it adds, e.g. the tracking server's login)."""
        train = self.workload.definition.train
        job = TrainingJob(
            key=key, workdir=workdir, command=list(train.command),
            env={**train.env, contract.HPARAMS: json.dumps(self.hyperparameters),
                 contract.CHECKPOINT_EVERY: str(self.checkpoint_every), **env},
            secrets=dict(train.secrets), secret_env=dict(secret_env or {}), resources=self.resources,
            image=image if image and image.reference else None, code=self.workload.code,
            python=self.workload.definition.environment.python,
        )  # fmt: skip
        check_job_secrets(job)
        return job

    def params(self) -> dict[str, object]:
        """What the MLflow run records as params: the hyperparameters and the resources."""
        params: dict[str, object] = dict(self.hyperparameters)
        params.update({f"resources.{k}": v for k, v in self.resources.model_dump().items()})
        params["checkpoint_every"] = self.checkpoint_every
        return params

    def check_model(self, info: ModelInfo, where: str) -> None:
        """The trained model can go through the deploy gate: gpuferry's server loads it (a python_function
        flavour), and there is a request to smoke-test it with. ``NoModel`` before anything is stored."""
        if self.server.mlflow_server and not info.pyfunc:
            raise NoModel(
                f"the MLflow model in {where} has no python_function flavour (it has {', '.join(info.flavors)}), so "
                "gpuferry's model server cannot load it: save it with a flavour that has one (mlflow.sklearn, "
                "mlflow.pytorch, mlflow.pyfunc, ...), or serve it with your own server (serve.command)"
            )
        if info.serving_example is None and self.serving.smoke_request is None and \
                self.workload.definition.serve.input_example is None:  # fmt: skip
            raise NoModel(
                f"the MLflow model in {where} has no serving input example, and nothing else says what request a new "
                "version must answer before it serves: save the model with input_example=<a few rows>, or declare "
                "serve.input_example in gpuferry.yaml (or pass serving.smoke_request)"
            )

    def version_tags(self, image: ImageRef) -> dict[str, str]:
        """How this run's model version is served, recorded on the version (``deploy-model`` reads it)."""
        tags = {
            **self.workload.run_tags(),
            SERVICE_TAG: self.serving.service,
            SERVER_TAG: self.server.model_dump_json(exclude={"workdir"}),
            IMAGE_TAG: image.reference or "",
        }
        if image.workdir:
            tags[IMAGE_WORKDIR_TAG] = image.workdir
        example = self.workload.definition.serve.input_example
        if example is not None and len(json.dumps(example)) <= MAX_TAG_CHARS:
            tags[INPUT_EXAMPLE_TAG] = json.dumps(example, separators=(",", ":"))
        return tags


def server_of(workload: Workload, image: ImageRef | None = None) -> ServerSpec:
    """What serves the workload's model: gpuferry's MLflow model server, or the workload's own command (run from
    the workload's directory here, or from the image's working directory in a container)."""
    serve = workload.definition.serve
    if serve.mlflow_server:
        return ServerSpec(env=dict(serve.env))
    workdir = image.workdir if image is not None and image.reference else workload.root
    return ServerSpec(
        command=list(serve.command or []), port=serve.port, health_path=serve.health_path,
        readiness_path=serve.readiness_path, prediction_path=serve.prediction_path, env=dict(serve.env),
        workdir=workdir,
    )  # fmt: skip


def plan_run(workload: Workload, training: TrainingSpec, serving: ServingSpec, promotion: PromotionPolicy) -> RunPlan:
    """``training``/``serving``/``promotion`` over ``workload``'s defaults; ``ConfigurationError`` naming
    every hyperparameter that does not match the workload's schema."""
    definition = workload.definition
    hyperparameters = definition.schema.validate(training.hyperparameters, what="training.hyperparameters")
    filled_promotion = promotion.model_copy(update={
        "metric": promotion.metric or definition.promotion.metric,
        "direction": promotion.direction or definition.promotion.direction,
    })  # fmt: skip
    filled_serving = serving.model_copy(update={"service_name": serving.service_name or definition.service_name})
    return RunPlan(
        workload=workload,
        experiment=training.experiment or definition.name,
        model_name=training.model_name or definition.name,
        hyperparameters=hyperparameters,
        resources=training.resources or definition.train.resources,
        checkpoint_every=training.checkpoint_every or definition.train.checkpoint_every,
        promotion=filled_promotion,
        serving=filled_serving,
        server=server_of(workload),
    )
