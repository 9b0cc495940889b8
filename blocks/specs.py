"""Typed inputs of the pipeline's steps.

They (``TrainingSpec``, ``ServingSpec``, ``PromotionPolicy``) are flow parameters: Prefect renders them as
forms in the UI, and pydantic rejects a bad value before anything runs, naming the field and what it allows.
The outputs, the small records the steps hand to each other, are ``blocks/records.py``'s.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocks.values import check_name, check_quantity

_GPU_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")


def check_gpu_devices(values: list[str], field: str) -> list[str]:
    """GPUs named by index ('0') or UUID ('GPU-...', 'MIG-...'), each once."""
    for value in values:
        if not isinstance(value, str) or not _GPU_ID.match(value):
            raise ValueError(f"{field}: {value!r} is not a GPU index or UUID (e.g. '0' or 'GPU-8f6e...')")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{field} names {', '.join(repeated)} more than once")
    return values


def _gpus_from_devices(data: Any, count_field: str) -> Any:
    """Fill the GPU count from ``gpu_devices`` when only the devices are given; refuse a count that disagrees."""
    if not isinstance(data, dict) or not data.get("gpu_devices"):
        return data
    devices, count = data["gpu_devices"], data.get(count_field) or 0
    if not count:
        return {**data, count_field: len(devices)}
    if isinstance(devices, list) and count != len(devices):
        raise ValueError(
            f"{count_field}={count} but gpu_devices names {len(devices)} GPU(s): give one of the two, "
            "or make them agree"
        )
    return data


class _Spec(BaseModel):
    # Unknown keys are errors: a typo in a parameter must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Spec):
    """What one training job asks of the cluster."""

    nodes: int = Field(1, ge=1, le=1024, description="Nodes for one job (more than one: multi-node torchrun).")
    processes_per_node: int = Field(1, ge=1, le=64, description="Training processes per node; usually one per GPU.")
    gpus_per_node: int = Field(0, ge=0, le=16, description="GPUs per node (0: CPU only).")
    cpus_per_task: int = Field(1, ge=1, le=1024, description="CPU cores per training process.")
    mem_gb: float | None = Field(None, gt=0, description="Memory per node in GiB (None: the cluster default).")
    time_limit_minutes: int = Field(60, ge=1, le=60 * 24 * 30, description="Wall-clock limit of the job.")
    partition: str | None = Field(None, description="Slurm partition (None: the cluster default).")
    account: str | None = Field(
        None, description="Slurm account the job is charged to (None: the stack's account, else the user's default)."
    )
    qos: str | None = Field(
        None,
        description="Slurm QoS of the job (None: the stack's QoS, else the association's default): a sweep on a "
        "preemptible QoS, the weekly retrain on a high one.",
    )
    nice: int | None = Field(
        None,
        ge=-2147483645,
        le=2147483645,
        description="Slurm priority adjustment, sbatch --nice (None: the stack's additional_directives, else 0): "
        "positive lowers the job's priority; a negative one needs a Slurm operator.",
    )
    max_requeues: int = Field(
        3, ge=0, le=100, description="How often a preempted job is requeued and resumed before giving up."
    )
    gpu_devices: list[str] = Field(
        default_factory=list,
        description="Particular GPUs of a Docker host, by index ('0') or UUID ('GPU-...'); empty: any free ones "
        "(gpus_per_node of them). Schedulers (Slurm, Kubernetes) choose GPUs themselves and refuse this.",
    )
    share_gpus: bool = Field(
        False,
        description="On a Docker host: the job may use GPUs that other sharing jobs or servers use too (no "
        "isolation between them); off: its GPUs are its own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _gpu_count(cls, data: Any) -> Any:
        return _gpus_from_devices(data, "gpus_per_node")

    @field_validator("gpu_devices")
    @classmethod
    def _gpu_devices(cls, value: list[str]) -> list[str]:
        return check_gpu_devices(value, "gpu_devices")

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_names(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else check_name(value, info.field_name)

    def over(self, base: Resources) -> Resources:
        """These resources over ``base`` (the workload's defaults), field by field: what was set here wins, the
        rest is ``base``'s. ``-p training.resources.qos=low`` changes the QoS and keeps the workload's GPUs."""
        return Resources.model_validate({**base.model_dump(), **self.model_dump(include=self.model_fields_set)})

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


class TrainingSpec(_Spec):
    """One training run of a workload; what is left empty comes from the workload's definition."""

    experiment: str | None = Field(
        None, description="MLflow experiment the run is logged to (None: the workload's name)."
    )
    model_name: str | None = Field(
        None, description="Registered model name in the MLflow registry (None: the workload's name)."
    )
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Hyperparameters, checked against the workload's JSON Schema; what is left out takes its default.",
    )
    resources: Resources | None = Field(
        None, description="Resources of the job, field by field over the workload's defaults (None: those defaults)."
    )
    checkpoint_every: int | None = Field(
        None, ge=1, description="Save a checkpoint every this many optimizer steps (None: the workload's setting)."
    )

    @field_validator("experiment", "model_name")
    @classmethod
    def _names(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else check_name(value, info.field_name)


class SweepGrid(_Spec):
    """The configurations a sweep trains: every combination of ``values``, plus ``configurations``.

    Each configuration overrides the sweep's base hyperparameters (``TrainingSpec.hyperparameters``); the
    names are checked against the workload's schema when the sweep starts.
    """

    values: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Hyperparameter name -> the values to try; the sweep trains every combination.",
    )
    configurations: list[dict[str, Any]] = Field(
        default_factory=list, description="Explicit configurations (partial hyperparameters), trained as well."
    )
    max_configurations: int = Field(
        1000, ge=1, le=10_000, description="The most configurations one sweep may train (one array task each)."
    )

    @model_validator(mode="after")
    def _valid(self) -> SweepGrid:
        for name, values in self.values.items():
            if not values:
                raise ValueError(f"values[{name!r}] is empty: give at least one value (or drop the key)")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"values[{name!r}] lists a value twice: {values}")
        if self.size == 0:
            raise ValueError("the sweep is empty: give values (a grid) or configurations")
        if self.size > self.max_configurations:
            raise ValueError(
                f"the sweep has {self.size} configurations, more than max_configurations={self.max_configurations}: "
                "trim values, or raise max_configurations"
            )
        return self

    @property
    def size(self) -> int:
        product = 1
        for values in self.values.values():
            product *= len(values)
        return (product if self.values else 0) + len(self.configurations)


MIG_PROFILES = (
    "1g.5gb",
    "1g.10gb",
    "1g.12gb",
    "1g.18gb",
    "1g.20gb",
    "1g.23gb",
    "1g.24gb",
    "1g.45gb",
    "2g.10gb",
    "2g.20gb",
    "2g.24gb",
    "2g.35gb",
    "2g.45gb",
    "3g.20gb",
    "3g.40gb",
    "3g.47gb",
    "3g.71gb",
    "3g.90gb",
    "4g.20gb",
    "4g.40gb",
    "4g.47gb",
    "4g.71gb",
    "4g.90gb",
    "7g.40gb",
    "7g.80gb",
    "7g.94gb",
    "7g.141gb",
    "7g.180gb",
)


class ServingShape(_Spec):
    """How many replicas of a service run, what each one gets and where clients reach it.

    A workload declares it (``gpuferry.yaml``'s ``serve:``), the model version records it when it is registered,
    and a deploy of that version serves it so; a run's own ``serving`` overrides it field by field (the fields
    the run sets). The stack's serving block gives what the shape leaves out (its CPU and memory, its URL).
    """

    replicas: int = Field(1, ge=1, le=1000, description="Serving replicas (the least, when autoscaling).")
    max_replicas: int | None = Field(
        None, ge=1, le=1000, description="Autoscale up to this many replicas (None: the stack's autoscaling)."
    )
    autoscale_cpu_percent: int | None = Field(
        None, ge=1, le=100, description="Autoscaling's target CPU utilization (None: the stack's)."
    )
    gpus: int = Field(0, ge=0, le=16, description="Whole GPUs per replica (0: CPU).")
    gpu_devices: list[str] = Field(
        default_factory=list,
        description="Particular GPUs of a Docker host, by index ('0') or UUID ('GPU-...'); empty: any free ones.",
    )
    share_gpus: bool = Field(
        False,
        description="A time-sliced share of a GPU: on a Docker host, GPUs other sharing servers use too; on "
        "Kubernetes, the device plugin's time-sliced resource (the stack's gpu_resource with '.shared').",
    )
    mig_profile: str | None = Field(None, description="A MIG slice per replica instead of whole GPUs, e.g. '1g.10gb'.")
    cpu_request: str | None = Field(None, description="CPU request per replica, e.g. '2' (None: the stack's).")
    memory_request: str | None = Field(None, description="Memory request per replica, e.g. '4Gi' (None: the stack's).")
    cpu_limit: str | None = Field(None, description="CPU limit per replica (None: the stack's).")
    memory_limit: str | None = Field(
        None, description="Memory limit per replica; a server above it is OOMKilled (None: the stack's)."
    )
    url: str | None = Field(
        None, description="The URL clients use for this service, e.g. its Ingress (None: what the backend reports)."
    )

    @model_validator(mode="before")
    @classmethod
    def _gpu_count(cls, data: Any) -> Any:
        return _gpus_from_devices(data, "gpus")

    @field_validator("gpu_devices")
    @classmethod
    def _gpu_devices(cls, value: list[str]) -> list[str]:
        return check_gpu_devices(value, "gpu_devices")

    @field_validator("mig_profile")
    @classmethod
    def _mig(cls, value: str | None) -> str | None:
        if value is not None and value not in MIG_PROFILES:
            raise ValueError(f"mig_profile={value!r} is not a MIG profile; use one of: {', '.join(MIG_PROFILES)}")
        return value

    @field_validator("cpu_request", "memory_request", "cpu_limit", "memory_limit")
    @classmethod
    def _quantity(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else check_quantity(value, info.field_name)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"url={value!r} is not an http(s) URL")
        return value

    @model_validator(mode="after")
    def _gpu_or_mig(self) -> Any:
        if self.mig_profile and (self.gpus or self.share_gpus):
            raise ValueError(
                "set either gpus or mig_profile, not both (a MIG slice is a fraction of one GPU), nor share_gpus "
                "with a MIG slice"
            )
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas={self.max_replicas} is below replicas={self.replicas}")
        return self

    def shape(self) -> ServingShape:
        """The shape alone (a ``ServingSpec``'s, without the rest)."""
        return ServingShape.model_validate(self.model_dump(include=set(SHAPE_FIELDS)))


# The shape's fields, and those that say what a replica's GPUs are: a run that sets one of them sets them all.
SHAPE_FIELDS = (
    "replicas",
    "max_replicas",
    "autoscale_cpu_percent",
    "gpus",
    "gpu_devices",
    "share_gpus",
    "mig_profile",
    "cpu_request",
    "memory_request",
    "cpu_limit",
    "memory_limit",
    "url",
)
GPU_FIELDS = ("gpus", "gpu_devices", "share_gpus", "mig_profile")


class RolloutPolicy(_Spec):
    """How a new version takes over a service: at once (``rolling``), or after live traffic judged it.

    ``canary``: the new version answers a share of the requests for a window; ``shadow``: a copy of a share of the
    requests goes to it and the two versions' answers are compared, while clients get the serving version's only.
    At the window's end the gates compare the two versions over the same window, from their servers' own
    ``/metrics``: the new version passes when every gate holds, and only then takes all the traffic.

    Where: ``DockerServing`` (through its front) and ``KubernetesCluster`` (the serving pods route the share to
    the new version's own Deployment) roll out ``rolling``, ``canary`` and ``shadow``; the other serving backends
    ``rolling`` only (a strategy the stack's backend does not do is refused before the run starts).
    """

    strategy: Literal["rolling", "canary", "shadow"] = Field(
        "rolling", description="rolling: the new version replaces the old at once; canary or shadow: judged first."
    )
    share: float = Field(
        0.1, gt=0, le=1, description="The share of requests the canary answers, or that are copied to the shadow."
    )
    window_seconds: float = Field(300, gt=0, le=86_400, description="How long the new version is judged.")
    window_requests: int | None = Field(
        None, ge=1, description="End the window early once the new version has answered this many requests."
    )
    min_requests: int = Field(
        100, ge=1, description="Fewer requests to the new version in the window: it fails (too little to judge)."
    )
    max_error_rate_increase: float = Field(
        0.01,
        ge=0,
        le=1,
        description="The new version's share of failed answers (not 2xx) may exceed the serving version's by at "
        "most this.",
    )
    max_p99_ratio: float = Field(
        1.5, ge=1, description="The new version's p99 latency may be at most this many times the serving version's ..."
    )
    p99_slack_ms: float = Field(
        5, ge=0, description="... plus this many milliseconds (latencies of a few ms are measured in coarse buckets)."
    )
    min_agreement: float = Field(
        0.99, ge=0, le=1, description="shadow: the share of compared rows whose answers must agree."
    )
    rtol: float = Field(1e-6, ge=0, le=1, description="shadow: numbers agree within this relative difference ...")
    atol: float = Field(0, ge=0, description="shadow: ... or within this absolute one; classes must be equal.")

    @model_validator(mode="after")
    def _canary_share(self) -> RolloutPolicy:
        if self.strategy == "canary" and self.share > 0.5:
            raise ValueError(
                f"rollout.share={self.share:g}: a canary answers at most half of the requests (0.5); for more, "
                "let it pass and take them all"
            )
        return self


class ServingSpec(ServingShape):
    """How the inference service runs."""

    service_name: str | None = Field(
        None, description="Name of the service (Kubernetes Deployment, local process); None: the workload's."
    )
    max_batch_size: int = Field(64, ge=1, le=65_536, description="Dynamic batching: most rows per forward pass.")
    max_batch_wait_ms: float = Field(2.0, ge=0, le=10_000, description="Dynamic batching: longest wait for a batch.")
    max_queue: int = Field(256, ge=1, description="Requests queued before the server answers 503.")
    ready_timeout_seconds: float = Field(
        120, gt=0, description="How long a new version may take to become ready before the deploy fails."
    )
    rollout: RolloutPolicy | None = Field(
        None,
        description="How the new version takes over: rolling, or judged by live traffic first (canary, shadow); "
        "None: the workload's serve.rollout.",
    )
    smoke_request: dict[str, Any] | None = Field(
        None,
        description="The request a new version must answer before traffic moves to it (None: the model's own "
        "serving input example, else the workload's serve.input_example; on Kubernetes sent to a new pod once the "
        "rollout is available, and a failure rolls back).",
    )

    @field_validator("service_name")
    @classmethod
    def _service_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "service_name")

    @property
    def service(self) -> str:
        """The service's name; set by the flow (from the workload) before a backend sees the spec."""
        if not self.service_name:
            raise ValueError("service_name is not set: the flow fills it in from the workload before deploying")
        return self.service_name

    @property
    def device(self) -> str:
        """Where gpuferry's model server runs the model (``MODEL_DEVICE``): ``cuda`` when the replica is given a
        GPU (whole, shared or a MIG slice), else ``cpu``."""
        return "cuda" if self.gpus or self.share_gpus or self.mig_profile else "cpu"

    def over(self, declared: ServingShape | None) -> ServingSpec:
        """This run's spec over the ``declared`` shape (the workload's, or the one a model version recorded): each
        shape field the run set (``model_fields_set``) is the run's, every other the declared one's. The GPU
        fields go together: a run that sets one of them sets what a replica's GPUs are."""
        if declared is None:
            return self
        data = self.model_dump()
        taken = set(self.model_fields_set)
        if taken & set(GPU_FIELDS):
            taken |= set(GPU_FIELDS)
        for field in SHAPE_FIELDS:
            if field not in taken:
                data[field] = getattr(declared, field)
        return ServingSpec.model_validate(data)


class PromotionPolicy(_Spec):
    """When a new model version becomes the champion (and gets deployed)."""

    metric: str | None = Field(None, description="Validation metric logged by the training run (None: the workload's).")
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="Which way is better (None: the workload's)."
    )
    min_improvement: float = Field(0.0, ge=0, description="How much better than the champion it must be.")
    alias: str = Field("champion", description="Registry alias that marks the version in production.")

    @field_validator("alias")
    @classmethod
    def _alias(cls, value: str) -> str:
        return check_name(value, "alias")

    def beats(self, candidate: float, champion: float | None) -> bool:
        if self.metric is None or self.direction is None:
            raise ValueError("the promotion metric and direction are not set: the flow fills them in from the workload")
        if champion is None:
            return True
        if self.direction == "maximize":
            return candidate > champion + self.min_improvement
        return candidate < champion - self.min_improvement


# ---- records handed from step to step -------------------------------------------------------
