"""A stack: one block for each step of the pipeline, and the checks of all of them at once.

A flow run is given a stack (by the name of a saved ``Stack`` block) and each step uses the backend
in it. With no stack the run uses ``Stack.embedded()``: local processes, a local directory, no
image, a local server and a SQLite MLflow store under ``$GPUFERRY_HOME`` — nothing to set up.

This module is the composition root of ``blocks/``: the one place that imports every backend.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any, cast

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import ConfigDict, Field

from blocks.aws.ec2 import Ec2Provider
from blocks.base.compute import ComputeBackend
from blocks.base.images import ImageBuilder
from blocks.base.provider import ClusterManaged, NodeProvider
from blocks.base.serving import ServingBackend
from blocks.base.storage import CheckpointStore
from blocks.checks import DEFAULT_TIMEOUT_S, CheckRow, Probe, run_groups
from blocks.docker.compute import DockerCompute
from blocks.docker.gpu_host import DockerGpuHost
from blocks.docker.image import DockerImageBuilder
from blocks.docker.serving import DockerServing
from blocks.errors import ConfigurationError
from blocks.home import gpuferry_home
from blocks.hosts.provider import SshHosts
from blocks.kubernetes.cluster import KubernetesCluster
from blocks.local.compute import LocalProcesses
from blocks.local.images import CurrentEnvironment
from blocks.local.provider import LocalMachine
from blocks.local.serving import LocalServing
from blocks.local.storage import LocalCheckpointStore
from blocks.records import Node
from blocks.slurm.cluster import SlurmCluster
from blocks.specs import Resources, ServingSpec
from blocks.storage.s3 import S3CheckpointStore
from blocks.tracking.mlflow import MlflowTracking

# The pipeline's steps, in order: the fields of a Stack, the sections of a stack file, the rows of a check.
STEPS = ("provider", "images", "compute", "storage", "tracking", "serving")

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
            return cast(Stack, cls.load(name))  # sync here: Prefect types it as a coroutine too
        except ValueError as exc:
            if "Unable to find block document" not in str(exc) and "not found" not in str(exc).lower():
                raise
        saved = cls.saved_names()
        raise ConfigurationError(
            f"stack={name!r}: no saved Stack block has that name; saved stacks: {', '.join(saved) or 'none'}. "
            "Give one of those, or save this one with `gpuferry stack apply FILE`"
        )

    def step_blocks(
        self,
    ) -> dict[str, NodeProvider | ImageBuilder | ComputeBackend | CheckpointStore | MlflowTracking | ServingBackend]:
        return {step: getattr(self, step) for step in STEPS}

    def needs_inventory(self) -> bool:
        """Whether a backend chooses GPUs itself (a Docker host) and does not know its host's GPUs yet."""
        return any(isinstance(b, DockerGpuHost) and b.gpu_inventory is None for b in (self.compute, self.serving))

    def with_inventory(self, nodes: list[Node]) -> Stack:
        """The stack with the provider's inspected ``nodes`` handed to the backends that choose GPUs themselves
        (Docker hosts: each takes its own node's GPU inventory)."""
        update = {
            step: block.with_inventory(nodes)
            for step in ("compute", "serving")
            if isinstance(block := getattr(self, step), DockerGpuHost)
        }
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

    def check(
        self, *, timeout: float = DEFAULT_TIMEOUT_S, more: Iterable[tuple[Probe, Callable[[Probe], Any]]] = ()
    ) -> list[CheckRow]:
        """Every backend's ``self_check`` at once, each group with its own deadline, and the groups ``more`` adds
        (the Prefect server's, a workload's: their rows come last). See ``blocks/checks.py``."""
        probe_id = uuid.uuid4().hex[:12]
        needs_image = bool(self.images.produces_image)
        groups: list[tuple[Probe, Callable[[Probe], Any]]] = []
        for step, block in self.step_blocks().items():
            probe = Probe(
                step,
                type(block).__name__,
                timeout=timeout,
                needs_image=needs_image,
                probe_id=probe_id,
                store=self.storage if step == "compute" else None,
            )
            groups.append((probe, block.self_check))
        return run_groups([*groups, *more])


def load_stack(stack: Stack | str | None) -> Stack:
    """The stack a run was given: a ``Stack`` block (picked in the UI), the name of a saved one (an error lists
    the saved stacks when there is none by that name), or nothing: the embedded stack."""
    if isinstance(stack, Stack):
        return stack
    return Stack.embedded() if not stack else Stack.named(stack)


def stack_name(stack: Stack | str | None) -> str:
    """The saved name of the run's stack ('' = embedded), for what must find it again (the job watcher)."""
    if isinstance(stack, Stack):
        name = stack._block_document_name
        if not name or stack._is_anonymous:
            raise ConfigurationError(
                "wait='suspend' needs a saved stack (the job watcher loads it by name): save it "
                "with `gpuferry stack apply FILE` and pass it, or its name"
            )
        return name
    return stack or ""


def saved_name(stack: Stack | str | None) -> str:
    """The saved name of a run's stack: '' for the embedded one (and for a Stack object never saved)."""
    if isinstance(stack, Stack):
        return "" if stack._is_anonymous else (stack._block_document_name or "")
    return stack or ""
