"""The records the pipeline's steps hand to one another: what a step produced (a node, an image, a job and its
status, a stored checkpoint, a model version, an endpoint), small and serialisable (Prefect keeps them as task
results). Their inputs, the flow parameters, are ``blocks/specs.py``'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from blocks.specs import Resources


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


# The image a model version was trained in (a reference by digest), on the registered version; and on a training
# run's MLflow run from the moment it starts (``flows/ship.run_tags``). ``gpuferry gc`` keeps the images they name.
IMAGE_TAG = "gpuferry.image"
RUN_IMAGE_TAG = "image"


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
        default_factory=dict,
        exclude=True,
        description="Variable -> value the pipeline itself hands the job (the tracking server's login); the backend "
        "delivers them like secrets. Never serialized: a job recorded to disk or in a state carries none.",
    )
    resources: Resources = Field(default_factory=Resources)
    image: ImageRef | None = None
    code: CodeRef | None = Field(None, description="The workload's code (runs without an image need it).")
    python: str | None = Field(
        None, description="Interpreter for a leading `python` without an image (None: the backend's)."
    )


class JobHandle(_Record):
    backend: str
    job_id: str
    key: str
    workdir: str
    log_path: str


JobStateName = Literal[
    "PENDING", "RUNNING", "PREEMPTED", "REQUEUED", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"
]
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"})


class JobStatus(_Record):
    job_id: str
    state: JobStateName
    exit_code: int | None = None
    reason: str = ""
    elapsed_seconds: float = 0.0
    nodes: str = Field("", description="The node(s) the job runs on, as the backend names them ('' while queued).")
    visible: bool = Field(
        True,
        description="False: the backend has no record of the job at all (not queued, not running, not in its "
        "accounting); one that stays so for the backend's lost_job_grace_seconds is lost.",
    )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def summary(self) -> str:
        """The state in a few words for a log line or a progress note: ``PENDING (Slurm reason: Priority)``,
        ``RUNNING on n1,n2``."""
        words = self.state + (f" on {self.nodes}" if self.nodes else "")
        return f"{words} ({self.reason})" if self.reason else words


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


class Garbage(_Record):
    """Something ``gpuferry gc`` may free: what it is, where, how big, when it was last written."""

    kind: Literal["checkpoint", "job directory", "code archive", "code directory", "image"]
    where: str = Field(description="Its URI or path.")
    size_bytes: int = 0
    modified: float = Field(description="When it was last written (epoch seconds).")


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
    workdir: str | None = Field(
        None, description="Where the command runs: the workload's directory (local) or in the image."
    )

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
