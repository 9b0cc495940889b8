"""A Docker host and its GPUs: the settings and GPU choice both Docker backends (training, serving) share.

The host's GPU inventory (index and UUID of each GPU) comes from the stack's provider: ``LocalMachine``
and ``SshHosts`` read it with ``nvidia-smi``, and the flow hands the provider's nodes to the backends
(``with_inventory``) before anything runs on them. A request for GPUs is checked against it before any
container exists; the GPUs in use are the engine's own record (``blocks/docker/engine.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from prefect_docker.credentials import DockerRegistryCredentials
from prefect_docker.host import DockerHost
from pydantic import Field, PrivateAttr, model_validator

from blocks.docker.engine import Engine
from blocks.docker.gpu_alloc import GpuRequest, HostGpu, check_fits, inventory_of
from blocks.docker.spec import check_cdi_kind, gpu_device_ids
from blocks.docker.transport import DockerTls, check_transport
from blocks.errors import ConfigurationError
from blocks.records import GpuInfo, Node
from blocks.ssh.credentials import SshCredentials


class DockerGpuHost(Block):
    """The Docker Engine (or podman) of one GPU host, and how its GPUs reach containers."""

    _block_type_name = "gpuferry Docker GPU Host"

    docker_host: DockerHost = Field(
        default_factory=DockerHost,
        description="The Docker engine: a local socket (unix://), tcp://HOST:2376 with TLS (set tls) or "
        "ssh://USER@HOST[:PORT] (set ssh); podman's Docker API socket too. Without base_url it follows DOCKER_HOST "
        "(and DOCKER_TLS_VERIFY/DOCKER_CERT_PATH).",
    )
    tls: DockerTls | None = Field(
        None,
        description="TLS for a tcp:// base_url, as `docker --tlsverify` takes it: the CA, and the client "
        "certificate and key an engine run with --tlsverify asks for (PEM texts).",
    )
    ssh: SshCredentials | None = Field(
        None,
        description="The SSH login for an ssh:// base_url (the same credentials block the Slurm cluster and "
        "SSH hosts take): private key and known_hosts lines; the user is base_url's, else this block's. That user "
        "runs `docker system dial-stdio` on the host (the docker CLI, and access to the engine's socket). None: "
        "docker-py's own (~/.ssh/config, ~/.ssh/id_*, ~/.ssh/known_hosts).",
    )
    registry_credentials: DockerRegistryCredentials | None = Field(
        None, description="Login for pulling the image (sent to the engine with the pull, never to a container)."
    )
    api: Literal["auto", "docker", "libpod"] = Field(
        "auto",
        description="How containers are created: the Docker Engine API, or podman's own (libpod), whose "
        "Docker-compatible API ignores GPU device requests; auto: libpod on podman, else docker.",
    )
    gpu_mode: Literal["auto", "nvidia", "cdi"] = Field(
        "auto",
        description="How GPUs reach a container: nvidia (Docker with the NVIDIA Container Toolkit: device "
        "requests by index or UUID, what --gpus sends) or cdi (CDI device names, cdi_kind=<index or UUID>: podman, "
        "or Docker 25+ with CDI enabled); auto: cdi on podman, nvidia on Docker.",
    )
    cdi_kind: str = Field(
        "nvidia.com/gpu", description="The CDI kind of the host's GPUs (what `nvidia-ctk cdi generate` writes)."
    )
    node: str | None = Field(
        None, description="The name of the provider's node this engine runs on (None: the provider's only node)."
    )
    gpu_inventory: list[GpuInfo] | None = Field(
        None,
        description="The host's GPUs (index, UUID). Filled in from the stack's provider (nvidia-smi on the "
        "node); set it by hand only for a host no provider reports. None: unknown (a GPU request then fails).",
    )
    request_timeout_seconds: float = Field(120.0, gt=0, description="Seconds one engine request may take.")

    _engine_client: Engine | None = PrivateAttr(None)
    _engine_for: tuple[Any, ...] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _transport_fits(self) -> DockerGpuHost:
        check_transport(self.docker_host.base_url, self.tls, self.ssh)  # a ConfigurationError is a ValueError
        return self

    # ---- the engine --------------------------------------------------------------------------

    def engine(self) -> Engine:
        secrets = [
            s.get_secret_value() if s else None
            for s in (
                self.tls and self.tls.client_key,
                self.ssh and self.ssh.private_key,
                self.ssh and self.ssh.private_key_passphrase,
            )
        ]
        key = (
            self.docker_host.model_dump_json(),
            self.api,
            self.request_timeout_seconds,
            self.tls.model_dump_json() if self.tls else None,
            self.ssh.model_dump_json() if self.ssh else None,
            hash(tuple(secrets)),
        )
        if self._engine_client is None or self._engine_for != key:
            self._engine_client = Engine(
                self.docker_host, api=self.api, timeout=self.request_timeout_seconds, tls=self.tls, ssh=self.ssh
            )
            self._engine_for = key
        return self._engine_client

    def close(self) -> None:
        if self._engine_client is not None:
            self._engine_client.close()
        self._engine_client = None

    # ---- the GPUs ----------------------------------------------------------------------------

    def with_inventory(self, nodes: list[Node]) -> DockerGpuHost:
        """This block with the GPU inventory of its node among ``nodes`` (as the provider inspected them); as
        it is when none of them is its node."""
        if self.node is not None:
            mine = [n for n in nodes if n.name == self.node]
        else:
            mine = list(nodes) if len(nodes) == 1 else []
        if not mine:
            return self
        return self.model_copy(update={"gpu_inventory": list(mine[0].gpus)})

    @property
    def host_label(self) -> str:
        return f"Docker host {self.node or self.engine().host_name}"

    def inventory(self) -> list[HostGpu] | None:
        return None if self.gpu_inventory is None else inventory_of(self.gpu_inventory)

    def check_gpu_request(self, request: GpuRequest, *, required: bool) -> list[HostGpu]:
        """The host's inventory, once ``request`` is known to fit it (no claims looked at). ``required``: an
        unknown inventory is an error when GPUs are asked for (else the check waits for the inventory)."""
        inventory = self.inventory()
        if request.wanted == 0:
            return inventory or []
        if inventory is None:
            if not required:
                return []
            raise ConfigurationError(
                f"asks for {request.wanted} GPU(s) but the GPU inventory of this Docker host is unknown: use a "
                "stack whose provider reads the host's GPUs with nvidia-smi (LocalMachine, SshHosts; set the "
                "block's node to the provider's name of this host), or set gpu_inventory on the block"
            )
        check_fits(inventory, request, host=self.host_label)
        return inventory

    def resolved_gpu_mode(self) -> str:
        """``gpu_mode`` with auto decided by the engine (asks it once)."""
        check_cdi_kind(self.cdi_kind)
        if self.gpu_mode != "auto":
            return self.gpu_mode
        return "cdi" if self.engine().api == "libpod" else "nvidia"

    def device_ids(self, gpus: list[HostGpu], request: GpuRequest, gpu_mode: str) -> tuple[str, ...]:
        return gpu_device_ids(
            [(g.index, g.uuid) for g in gpus], by_uuid=request.by_uuid, gpu_mode=gpu_mode, cdi_kind=self.cdi_kind
        )
