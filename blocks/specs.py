"""Typed inputs and outputs of the pipeline's steps.

The inputs (``TrainingSpec``, ``ServingSpec``, ``PromotionPolicy``) are flow parameters: Prefect
renders them as forms in the UI, and pydantic rejects a bad value before anything runs, naming the
field and what it allows. The outputs are the small records the steps hand to each other.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_NAME_HELP = "1-63 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


_GPU_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")


def check_name(value: str, field: str) -> str:
    """Validate a name that ends up in paths, job names and labels (no shell metacharacters)."""
    if not _NAME.match(value):
        raise ValueError(f"{field}={value!r} is not allowed: use {_NAME_HELP}")
    return value


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
        raise ValueError(f"{count_field}={count} but gpu_devices names {len(devices)} GPU(s): give one of the two, "
                         "or make them agree")
    return data


class _Spec(BaseModel):
    # Unknown keys are errors: a typo in a parameter must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Spec):
    """What one training job asks of the cluster."""

    nodes: int = Field(1, ge=1, le=1024, description="Nodes for one job (more than one: multi-node torchrun).")
    processes_per_node: int = Field(
        1, ge=1, le=64, description="Training processes per node; usually one per GPU."
    )
    gpus_per_node: int = Field(0, ge=0, le=16, description="GPUs per node (0: CPU only).")
    cpus_per_task: int = Field(1, ge=1, le=1024, description="CPU cores per training process.")
    mem_gb: float | None = Field(None, gt=0, description="Memory per node in GiB (None: the cluster default).")
    time_limit_minutes: int = Field(60, ge=1, le=60 * 24 * 30, description="Wall-clock limit of the job.")
    partition: str | None = Field(None, description="Slurm partition (None: the cluster default).")
    max_requeues: int = Field(
        3, ge=0, le=100, description="How often a preempted job is requeued and resumed before giving up."
    )
    gpu_devices: list[str] = Field(
        default_factory=list,
        description="Particular GPUs of a Docker host, by index ('0') or UUID ('GPU-...'); empty: any free ones "
        "(gpus_per_node of them). Schedulers (Slurm, Kubernetes) choose GPUs themselves and refuse this.",
    )
    share_gpus: bool = Field(
        False, description="On a Docker host: the job may use GPUs that other sharing jobs or servers use too (no "
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

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "partition")

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


class TrainingSpec(_Spec):
    """One training run of a workload; what is left empty comes from the workload's definition."""

    experiment: str | None = Field(None, description="MLflow experiment the run is logged to (None: the workload's name).")
    model_name: str | None = Field(None, description="Registered model name in the MLflow registry (None: the workload's name).")
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Hyperparameters, checked against the workload's JSON Schema; what is left out takes its default.",
    )
    resources: Resources | None = Field(None, description="Resources of the job (None: the workload's defaults).")
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
    "1g.5gb", "1g.10gb", "1g.12gb", "1g.18gb", "1g.20gb", "1g.23gb", "1g.24gb", "1g.45gb",
    "2g.10gb", "2g.20gb", "2g.24gb", "2g.35gb", "2g.45gb", "3g.20gb", "3g.40gb", "3g.47gb",
    "3g.71gb", "3g.90gb", "4g.20gb", "4g.40gb", "4g.47gb", "4g.71gb", "4g.90gb", "7g.40gb",
    "7g.80gb", "7g.94gb", "7g.141gb", "7g.180gb",
)  # fmt: skip


class ServingSpec(_Spec):
    """How the inference service runs."""

    service_name: str | None = Field(
        None, description="Name of the service (Kubernetes Deployment, local process); None: the workload's."
    )
    replicas: int = Field(1, ge=1, le=1000, description="Serving replicas (Kubernetes).")
    gpus: int = Field(0, ge=0, le=16, description="Whole GPUs per replica (0: CPU).")
    gpu_devices: list[str] = Field(
        default_factory=list,
        description="Particular GPUs of a Docker host, by index ('0') or UUID ('GPU-...'); empty: any free ones.",
    )
    share_gpus: bool = Field(
        False, description="On a Docker host: the server may use GPUs that other sharing jobs or servers use too.",
    )
    mig_profile: str | None = Field(
        None, description="A MIG slice per replica instead of whole GPUs, e.g. '1g.10gb'."
    )
    max_batch_size: int = Field(64, ge=1, le=65_536, description="Dynamic batching: most rows per forward pass.")
    max_batch_wait_ms: float = Field(2.0, ge=0, le=10_000, description="Dynamic batching: longest wait for a batch.")
    max_queue: int = Field(256, ge=1, description="Requests queued before the server answers 503.")
    ready_timeout_seconds: float = Field(
        120, gt=0, description="How long a new version may take to become ready before the deploy fails."
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

    @model_validator(mode="before")
    @classmethod
    def _gpu_count(cls, data: Any) -> Any:
        return _gpus_from_devices(data, "gpus")

    @field_validator("gpu_devices")
    @classmethod
    def _gpu_devices(cls, value: list[str]) -> list[str]:
        return check_gpu_devices(value, "gpu_devices")

    @property
    def service(self) -> str:
        """The service's name; set by the flow (from the workload) before a backend sees the spec."""
        if not self.service_name:
            raise ValueError("service_name is not set: the flow fills it in from the workload before deploying")
        return self.service_name

    @field_validator("mig_profile")
    @classmethod
    def _mig(cls, value: str | None) -> str | None:
        if value is not None and value not in MIG_PROFILES:
            raise ValueError(f"mig_profile={value!r} is not a MIG profile; use one of: {', '.join(MIG_PROFILES)}")
        return value

    @model_validator(mode="after")
    def _gpu_or_mig(self) -> ServingSpec:
        if self.mig_profile and self.gpus:
            raise ValueError("set either gpus or mig_profile, not both (a MIG slice is a fraction of one GPU)")
        return self


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


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class GpuInfo(_Record):
    index: int
    name: str
    memory_mib: int
    driver_version: str
    cuda_version: str | None = None
    uuid: str | None = Field(None, description="nvidia-smi's GPU UUID (GPU-...), which stays when indices move.")


class Node(_Record):
    """A machine a provider handed us."""

    name: str
    provider: str
    gpus: list[GpuInfo] = Field(default_factory=list)
    cpus: int = 0
    memory_mib: int = 0
    state: str = "ready"
    labels: dict[str, str] = Field(default_factory=dict)


class ImageRef(_Record):
    """What the training job and the server run in."""

    builder: str
    content_tag: str = Field(description="Hash of the build context, Dockerfile and build args.")
    reference: str | None = Field(None, description="image@sha256:... pinned by digest; None: no image.")
    workdir: str | None = Field(None, description="Where the workload's code is inside the image (None: its WORKDIR).")
    built: bool = False
    note: str = ""


class CodeRef(_Record):
    """A workload's code: its directory here and the same files as one content-addressed archive."""

    root: str = Field(description="The workload's directory on this machine (holds gpuferry.yaml).")
    archive: str = Field(description="A .tar.gz of the workload's files, named by its sha256.")
    sha256: str = Field(description="sha256 of the archive: the code's identity.")
    files: int = 0
    size_bytes: int = 0


class TrainingJob(_Record):
    """A training job as a compute backend receives it."""

    key: str = Field(description="Deterministic key (flow run + step): a resubmit adopts the job that has it.")
    workdir: str = Field(description="Directory the job owns: checkpoints, progress, logs.")
    command: list[str] = Field(description="argv of the job, run from the workload's directory (no shell).")
    env: dict[str, str] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(
        default_factory=dict, description="Variable -> Prefect Secret block name; the backend delivers the values."
    )
    secret_env: dict[str, SecretStr] = Field(
        default_factory=dict, exclude=True,
        description="Variable -> value the pipeline itself hands the job (the tracking server's login); the backend "
        "delivers them like secrets. Never serialized: a job recorded to disk or in a state carries none.",
    )  # fmt: skip
    resources: Resources = Field(default_factory=Resources)
    image: ImageRef | None = None
    code: CodeRef | None = Field(None, description="The workload's code (runs without an image need it).")
    python: str | None = Field(None, description="Interpreter for a leading `python` without an image (None: the backend's).")


class JobHandle(_Record):
    backend: str
    job_id: str
    key: str
    workdir: str
    log_path: str


JobStateName = Literal["PENDING", "RUNNING", "PREEMPTED", "REQUEUED", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"]
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"})


class JobStatus(_Record):
    job_id: str
    state: JobStateName
    exit_code: int | None = None
    reason: str = ""
    elapsed_seconds: float = 0.0
    visible: bool = Field(
        True, description="False: the backend has no record of the job at all (not queued, not running, not in its "
        "accounting); one that stays so for the backend's lost_job_grace_seconds is lost.",
    )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


class JobResult(_Record):
    handle: JobHandle
    status: JobStatus
    checkpoint_dir: str = Field(description="CHECKPOINT_DIR of the job; the trained model is in its final/.")
    requeues: int = 0
    wall_seconds: float = 0.0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0


class SweepTaskResult(_Record):
    """One configuration of a sweep (one array task) once the array is done."""

    index: int
    status: JobStatus
    checkpoint_dir: str = Field(description="CHECKPOINT_DIR of the task; a trained model is in its final/.")
    requeues: int = 0
    wall_seconds: float = 0.0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0


class SweepJobResult(_Record):
    """A sweep's job array once every task has ended (some may have failed)."""

    handle: JobHandle
    tasks: list[SweepTaskResult]
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0

    @property
    def completed(self) -> list[SweepTaskResult]:
        return [t for t in self.tasks if t.status.state == "COMPLETED"]


class CheckpointRef(_Record):
    """A checkpoint in storage: its manifest (path, size, sha256 of each file) was written last."""

    uri: str
    sha256: str = Field(description="sha256 of the manifest, which lists every file's sha256.")
    size_bytes: int
    files: int
    bytes_uploaded: int = 0


class ModelVersionRef(_Record):
    name: str
    version: str
    run_id: str
    source: str
    metric: str
    value: float
    promoted: bool
    champion_before: str | None = None
    champion_value: float | None = None


class ServerSpec(_Record):
    """The process that serves a model: gpuferry's MLflow model server (``command`` None) or the workload's own."""

    command: list[str] | None = Field(None, description="argv of the workload's own server (None: runtime/serve.py).")
    port: int = Field(8080, description="Port the server listens on inside its container (PORT).")
    health_path: str = "/healthz"
    readiness_path: str = "/readyz"
    prediction_path: str = "/invocations"
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, description="Where the command runs: the workload's directory (local) or in the image.")

    @property
    def mlflow_server(self) -> bool:
        return self.command is None


class Endpoint(_Record):
    service: str
    url: str
    model_version: str
    backend: str
    previous_version: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class PipelineResult(_Record):
    run_id: str
    run_url: str
    image: ImageRef
    checkpoint: CheckpointRef
    model_version: ModelVersionRef
    metrics: dict[str, float]
    endpoint: Endpoint | None = None
    deployed: bool = False


class SweepResult(_Record):
    """What a sweep produced: the best configuration, carried through the pipeline."""

    parent_run_id: str
    child_run_ids: list[str]
    best_index: int
    best_hyperparameters: dict[str, Any]
    completed: int
    failed: int
    gpu_hours: float
    cpu_hours: float
    pipeline: PipelineResult
