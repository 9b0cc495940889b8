"""A stack: one block for each step of the pipeline.

A flow run is given a stack (by the name of a saved ``Stack`` block) and each step uses the backend
in it. With no stack the run uses ``Stack.embedded()``: local processes, a local directory, no
image, a local server and a SQLite MLflow store under ``$GPUFERRY_HOME`` — nothing to set up.
"""

from __future__ import annotations

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import Field

from blocks.compute import ComputeBackend, LocalProcesses
from blocks.docker_image import DockerImageBuilder
from blocks.home import gpuferry_home
from blocks.kubernetes import KubernetesCluster
from blocks.images import CurrentEnvironment, ImageBuilder
from blocks.ec2 import Ec2Provider
from blocks.provision import ClusterManaged, LocalMachine, NodeProvider
from blocks.ssh_hosts import SshHosts
from blocks.s3 import S3CheckpointStore
from blocks.serving import LocalServing, ServingBackend
from blocks.slurm import SlurmCluster
from blocks.storage import CheckpointStore, LocalCheckpointStore
from blocks.tracking import MlflowTracking


# Prefect registers a block's nested block types from its field annotations, and an interface
# (an ABC) cannot be registered: each field names the concrete choices, and the UI offers them.
ProviderChoice = LocalMachine | ClusterManaged | SshHosts | Ec2Provider
ImageChoice = CurrentEnvironment | DockerImageBuilder
ComputeChoice = LocalProcesses | SlurmCluster
StorageChoice = LocalCheckpointStore | S3CheckpointStore
ServingChoice = LocalServing | KubernetesCluster


class Stack(Block):
    """The backends one pipeline run uses, step by step."""

    _block_type_name = "gpuferry Stack"
    _description = "Which backend each pipeline step uses: provisioning, image, compute, storage, tracking, serving."

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

    def step_blocks(self) -> dict[str, NodeProvider | ImageBuilder | ComputeBackend | CheckpointStore | MlflowTracking | ServingBackend]:
        return {step: getattr(self, step) for step in ("provider", "images", "compute", "storage", "tracking", "serving")}

    def backends(self) -> dict[str, str]:
        """The block type of each step, for the run's tags."""
        return {step: block.get_block_type_slug() for step, block in self.step_blocks().items()}
