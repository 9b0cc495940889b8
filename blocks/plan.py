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
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, SecretStr

from blocks.base.mlflow_model import ModelInfo, NoModel
from blocks.base.secrets import check_job_secrets
from blocks.errors import ConfigurationError
from blocks.records import IMAGE_TAG, ImageRef, ServerSpec, TrainingJob
from blocks.specs import PromotionPolicy, Resources, ServingSpec, TrainingSpec
from blocks.workload.source import Workload
from runtime import contract

if TYPE_CHECKING:
    from blocks.stack import Stack

# Model version tags that say how a version is served (deploy-model reads them back).
TAG_PREFIX = "gpuferry."
SERVICE_TAG = "gpuferry.service"
SERVER_TAG = "gpuferry.server"
IMAGE_WORKDIR_TAG = "gpuferry.image.workdir"
SERVING_TAG = "gpuferry.serving"  # the service's shape (ServingShape as JSON): replicas, GPUs, CPU, memory, URL
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

    def job(
        self,
        key: str,
        workdir: str,
        image: ImageRef | None,
        env: dict[str, str],
        secret_env: Mapping[str, SecretStr] | None = None,
    ) -> TrainingJob:
        """The training job of this plan (``env``: what the pipeline adds, e.g. the MLflow run; ``secret_env``:
        the secrets it adds, e.g. the tracking server's login)."""
        train = self.workload.definition.train
        job = TrainingJob(
            key=key,
            workdir=workdir,
            command=list(train.command),
            env={
                **train.env,
                contract.HPARAMS: json.dumps(self.hyperparameters),
                contract.CHECKPOINT_EVERY: str(self.checkpoint_every),
                **env,
            },
            secrets=dict(train.secrets),
            secret_env=dict(secret_env or {}),
            resources=self.resources,
            image=image if image and image.reference else None,
            code=self.workload.code,
            python=self.workload.definition.environment.python,
        )
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
        if (
            info.serving_example is None
            and self.serving.smoke_request is None
            and self.workload.definition.serve.input_example is None
        ):
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
            SERVING_TAG: self.serving.shape().model_dump_json(exclude_defaults=True),
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
        command=list(serve.command or []),
        port=serve.port,
        health_path=serve.health_path,
        readiness_path=serve.readiness_path,
        prediction_path=serve.prediction_path,
        env=dict(serve.env),
        workdir=workdir,
    )


def plan_run(workload: Workload, training: TrainingSpec, serving: ServingSpec, promotion: PromotionPolicy) -> RunPlan:
    """``training``/``serving``/``promotion`` over ``workload``'s defaults; ``ConfigurationError`` naming
    every hyperparameter that does not match the workload's schema."""
    definition = workload.definition
    hyperparameters = definition.schema.validate(training.hyperparameters, what="training.hyperparameters")
    filled_promotion = promotion.model_copy(
        update={
            "metric": promotion.metric or definition.promotion.metric,
            "direction": promotion.direction or definition.promotion.direction,
        }
    )
    # The workload's declared shape, and over it, field by field, what this run's serving sets.
    filled_serving = serving.over(definition.serve.shape())
    filled_serving = filled_serving.model_copy(
        update={
            "service_name": serving.service_name or definition.service_name,
            "rollout": serving.rollout or definition.serve.rollout,
        }
    )
    return RunPlan(
        workload=workload,
        experiment=training.experiment or definition.name,
        model_name=training.model_name or definition.name,
        hyperparameters=hyperparameters,
        resources=(
            training.resources.over(definition.train.resources) if training.resources else definition.train.resources
        ),
        checkpoint_every=training.checkpoint_every or definition.train.checkpoint_every,
        promotion=filled_promotion,
        serving=filled_serving,
        server=server_of(workload),
    )


# ---- the run against the stack, before anything is acquired or submitted ----------------------------


def preflight(blocks: Stack, run: RunPlan) -> None:
    """Every check of the stack and the run before anything is acquired or submitted: first those that need no
    outside call, so that a mistake in the stack is reported before any host is contacted; then the compute
    backend's check of the job, which may ask its cluster (a Slurm partition, the container runtime). The
    serving backend's checks against its cluster follow (``serving_preflight``)."""
    image = preflight_image(blocks, run)
    blocks.compute.check_store(blocks.storage)  # a model the cluster writes must reach the stack's store
    blocks.compute.check_tracking(blocks.tracking.tracking_uri)  # and its jobs must reach the tracking server
    check_images_for_serving(blocks)
    if blocks.images.produces_image and run.workload.definition.image is None:
        raise ConfigurationError(
            f"stack.images ({type(blocks.images).__name__}) builds the workload's image, but {run.workload.root}/"
            "gpuferry.yaml has no image section: add one (dockerfile, base + requirements, or prebuilt)"
        )
    blocks.serving.validate(run.serving)
    check_rollout(blocks, run)
    blocks.compute.validate_job(
        run.job("preflight", "/nonexistent", image, env={}, secret_env=blocks.tracking.job_secrets())
    )


def check_rollout(blocks: Stack, run: RunPlan) -> None:
    """A canary or shadow rollout needs a serving backend that does it, and gpuferry's model server (its
    ``/metrics`` are what the versions are judged by)."""
    rollout = run.serving.rollout
    if rollout is None or rollout.strategy == "rolling":
        return
    backend = blocks.serving
    if rollout.strategy not in backend.rollout_strategies:
        raise ConfigurationError(
            f"serving.rollout.strategy={rollout.strategy!r}: stack.serving ({type(backend).__name__}) rolls out "
            f"{' or '.join(backend.rollout_strategies)} only; use one of those (serve.rollout in gpuferry.yaml, or "
            "the run's serving.rollout), or a stack whose serving backend does it"
        )
    if not run.workload.definition.serve.mlflow_server:
        raise ConfigurationError(
            f"serving.rollout.strategy={rollout.strategy!r} judges the new version by the /metrics of gpuferry's "
            "model server, and this workload runs its own (serve.command): use rollout strategy 'rolling', or "
            "gpuferry's server"
        )


def check_images_for_serving(blocks: Stack) -> None:
    """A serving backend that runs containers needs a stack that builds the image it runs."""
    if blocks.serving.needs_image and not blocks.images.produces_image:
        raise ConfigurationError(
            f"stack.serving ({type(blocks.serving).__name__}) runs the workload's container image, but "
            f"stack.images ({type(blocks.images).__name__}) builds none: choose an image builder that pushes "
            "one (DockerImageBuilder) in the stack"
        )


def preflight_image(blocks: Stack, run: RunPlan) -> ImageRef | None:
    """A stand-in for the image the build step will pin, when the stack builds one: the job then runs
    inside it, so that path is checked (a container runtime, not shipped code, is needed)."""
    if not blocks.images.produces_image:
        return None
    return ImageRef(
        builder="preflight",
        content_tag="preflight",
        reference=f"preflight/image@sha256:{'0' * 64}",
        workdir=run.workload.image_workdir(),
    )
