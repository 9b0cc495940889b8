"""A stack: one block for each step of the pipeline.

A flow run is given a stack (by the name of a saved ``Stack`` block) and each step uses the backend
in it. With no stack the run uses ``Stack.embedded()``: local processes, a local directory, no
image, a local server and a SQLite MLflow store under ``$GPUFERRY_HOME`` — nothing to set up.
"""

from __future__ import annotations

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import ConfigDict, Field

from blocks.compute import ComputeBackend, LocalProcesses
from blocks.docker_compute import DockerCompute
from blocks.docker_gpu_host import DockerGpuHost
from blocks.docker_image import DockerImageBuilder
from blocks.docker_serving import DockerServing
from blocks.home import gpuferry_home
from blocks.kubernetes import KubernetesCluster
from blocks.images import CurrentEnvironment, ImageBuilder
from blocks.ec2 import Ec2Provider
from blocks.errors import ConfigurationError
from blocks.provision import ClusterManaged, LocalMachine, NodeProvider
from blocks.ssh_hosts import SshHosts
from blocks.s3 import S3CheckpointStore
from blocks.serving import LocalServing, ServingBackend
from blocks.slurm import SlurmCluster
from blocks.specs import Node, Resources, ServingSpec
from blocks.storage import CheckpointStore, LocalCheckpointStore
from blocks.tracking import MlflowTracking


# Prefect registers a block's nested block types from its field annotations, and an interface
# (an ABC) cannot be registered: each field names the concrete choices, and the UI offers them.
ProviderChoice = LocalMachine | ClusterManaged | SshHosts | Ec2Provider
ImageChoice = CurrentEnvironment | DockerImageBuilder
ComputeChoice = LocalProcesses | SlurmCluster | DockerCompute
StorageChoice = LocalCheckpointStore | S3CheckpointStore
ServingChoice = LocalServing | KubernetesCluster | DockerServing


class Stack(Block):
    """The backends one pipeline run uses, step by step."""

    _block_type_name = "gpuferry Stack"
    _description = "Which backend each pipeline step uses: provisioning, image, compute, storage, tracking, serving."
    # A refused value is not repeated in the error: it may be a backend's password.
    model_config = ConfigDict(hide_input_in_errors=True)

    provider: ProviderChoice = Field(description="Where the nodes come from.")
    images: ImageChoice = Field(description="How the workload's image is built.")
    compute: ComputeChoice = Field(description="Where training runs.")
    storage: StorageChoice = Field(description="Where checkpoints are stored.")
    tracking: MlflowTracking = Field(description="MLflow tracking and registry.")
    serving: ServingChoice = Field(description="Where the inference service runs.")

    @classmethod
    def embedded(cls) -> Stack:
        home = gpuferry_home()
        return cls(
            provider=LocalMachine(),
            images=CurrentEnvironment(),
            compute=LocalProcesses(),
            storage=LocalCheckpointStore(filesystem=LocalFileSystem(basepath=str(home / "storage"))),
            tracking=MlflowTracking(),
            serving=LocalServing(),
        )

    @classmethod
    def saved_names(cls) -> list[str]:
        """The names of the saved Stack blocks on the Prefect server."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

        with get_client(sync_client=True) as client:
            try:
                documents = client.read_block_documents_by_type(cls.get_block_type_slug(), include_secrets=False)
            except (ObjectNotFound, PrefectHTTPStatusError) as exc:
                if isinstance(exc, PrefectHTTPStatusError) and exc.response.status_code != 404:
                    raise
                return []  # no Stack was ever saved: the block type is not registered yet
        return sorted(d.name for d in documents if d.name and not d.is_anonymous)

    @classmethod
    def named(cls, name: str) -> Stack:
        """The saved Stack block ``name``; when there is none, an error that lists the saved ones."""
        try:
            return cls.load(name)
        except ValueError as exc:
            if "Unable to find block document" not in str(exc) and "not found" not in str(exc).lower():
                raise
        saved = cls.saved_names()
        raise ConfigurationError(
            f"stack={name!r}: no saved Stack block has that name; saved stacks: {', '.join(saved) or 'none'}. "
            "Give one of those, or save this one with `gpuferry stack apply FILE`"
        )

    def step_blocks(self) -> dict[str, NodeProvider | ImageBuilder | ComputeBackend | CheckpointStore | MlflowTracking | ServingBackend]:
        return {step: getattr(self, step) for step in ("provider", "images", "compute", "storage", "tracking", "serving")}

    def needs_inventory(self) -> bool:
        """Whether a backend chooses GPUs itself (a Docker host) and does not know its host's GPUs yet."""
        return any(isinstance(b, DockerGpuHost) and b.gpu_inventory is None for b in (self.compute, self.serving))

    def with_inventory(self, nodes: list[Node]) -> Stack:
        """The stack with the provider's inspected ``nodes`` handed to the backends that choose GPUs themselves
        (Docker hosts: each takes its own node's GPU inventory)."""
        update = {step: block.with_inventory(nodes) for step in ("compute", "serving")
                  if isinstance(block := getattr(self, step), DockerGpuHost)}  # fmt: skip
        return self.model_copy(update=update) if update else self

    def check_gpus(self, resources: Resources, serving: ServingSpec) -> None:
        """The run's GPU requests against the inventories of the Docker hosts that choose GPUs themselves: a
        count larger than the host's, or an index or UUID it lacks, is a ``ConfigurationError`` naming the host's
        GPUs; so is a request to a host whose inventory is still unknown. Once the provider's nodes are in
        (``with_inventory``), before anything is built or submitted on them."""
        if isinstance(self.compute, DockerCompute):
            self.compute.check_gpu_request(self.compute.gpu_request(resources), required=True)
        if isinstance(self.serving, DockerServing):
            self.serving.check_gpu_request(self.serving.gpu_request(serving), required=True)

    def backends(self) -> dict[str, str]:
        """The block type of each step, for the run's tags."""
        return {step: block.get_block_type_slug() for step, block in self.step_blocks().items()}
