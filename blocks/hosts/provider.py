"""Bring your own GPU nodes: hosts reached over SSH, checked and set up in parallel.

``SshHosts`` is a ``NodeProvider`` over a fixed list of hosts. ``acquire(count)`` hands out the first
``count`` of them (there is nothing to create). The login and the trusted host keys are its
``credentials`` (an ``SshCredentials`` block, the one ``SlurmCluster`` takes too); every host's SSH host key
is checked against their ``known_hosts``: an unknown or changed key is refused, never added, and the error
names the host, the fingerprint it offered and the fix. Every command is an argv list joined with
``shlex.quote`` (``blocks/hosts/shell.py``, over ``blocks/ssh/session.py``).

``inspect(nodes)`` reads, on every node at once (one thread each, up to ``max_parallel``), its GPUs, driver,
CUDA version, NVIDIA Container Toolkit and docker's runtimes (``blocks/hosts/facts.py``).

``bootstrap(nodes, requirements)`` runs the preflight (GPUs against the job's minimums, the toolkit
present, docker answering) and then, only where docker lacks the ``nvidia`` runtime, runs
``nvidia-ctk runtime configure --runtime=docker`` and restarts docker, and reads the runtimes back
to confirm. Each node reports ``labels["bootstrap"]`` = ``changed`` (with ``labels["changes"]``)
or ``unchanged``: a second run changes nothing. Nodes are set up independently: a host that fails
(preflight, or unreachable after ``connect_attempts`` tries with exponential backoff) does not stop
the others; once all finished, ``NodesFailed``/``NodesUnreachable`` lists the failed hosts and
carries every node's outcome (``Node.state``: ready, failed, unreachable).

With ``slurm`` set (a ``SlurmJoin``), bootstrap also joins every node to a Slurm cluster as a
dynamic node (Slurm >= 22.05), and ``release(nodes)`` takes it out again (``blocks/hosts/slurm_join.py``).
Without ``slurm``, release gives nothing back: the hosts are yours and stay as they are.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import paramiko
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from blocks.base.log import run_logger
from blocks.base.provider import (
    STATE_ACQUIRED,
    STATE_FAILED,
    STATE_READY,
    STATE_UNREACHABLE,
    NodeProvider,
    NodeRequirements,
    raise_for_failures,
)
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.hosts.facts import PreflightFailed, configure_runtime, preflight, read_facts, read_runtimes, with_facts
from blocks.hosts.shell import HostShell
from blocks.hosts.slurm_join import SLURM_NODE_NAME, SlurmJoin, join_slurm, leave_slurm
from blocks.records import Node
from blocks.ssh.credentials import SshCredentials, credentials_from_flat
from blocks.ssh.session import TRANSPORT_ERRORS, SshSession

# The older flat credential fields of SshHosts (its hosts name their own users).
FLAT_CREDENTIAL_FIELDS = ("private_key", "private_key_passphrase", "known_hosts")


class SshHost(BaseModel):
    """One host of an ``SshHosts`` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(min_length=1, description="IP address or DNS name the host is reached at.")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str | None = Field(
        None, description="SSH user (root, or a user allowed `sudo -n`); None: the credentials' user, else root."
    )
    name: str | None = Field(None, description="Node name (default: the address, with :port when not 22).")

    @property
    def node_name(self) -> str:
        if self.name:
            return self.name
        return self.address if self.port == 22 else f"{self.address}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """How known_hosts (and paramiko) names this host."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


class SshHosts(NodeProvider):
    """Your own GPU hosts over SSH (verified host keys), checked and bootstrapped in parallel."""

    _block_type_name = "gpuferry SSH Hosts"
    _description = (
        "Bring-your-own GPU hosts reached over SSH: checks GPUs, driver, CUDA and the NVIDIA Container Toolkit, "
        "configures docker's nvidia runtime where it is missing and joins the hosts to a Slurm cluster, on all "
        "hosts at once."
    )
    # A validation error never echoes its input: the input may hold the private key.
    model_config = ConfigDict(hide_input_in_errors=True)
    # The older flat credential fields, as a stack file may still name them (``blocks/stack_file.py``).
    field_aliases: ClassVar[dict[str, tuple[str, str]]] = {f: ("credentials", f) for f in FLAT_CREDENTIAL_FIELDS}

    hosts: list[SshHost] = Field(min_length=1, description="The hosts (address, port, user, optional name).")
    credentials: SshCredentials = Field(
        description="SSH login for every host: private key, known_hosts lines of every host (`ssh-keyscan -p PORT "
        "ADDRESS`; unknown or changed keys are refused) and the user of hosts that name none. (The older flat "
        "fields private_key, private_key_passphrase and known_hosts still load into it.)",
    )
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to wait for one SSH connection attempt.")
    connect_attempts: int = Field(
        4, ge=1, le=20, description="Connection attempts per host before it counts as unreachable."
    )
    retry_backoff_seconds: float = Field(
        1.0, ge=0, description="Wait after the first failed connection attempt; doubled after each further one."
    )
    command_timeout: float = Field(120.0, gt=0, description="Seconds one command on a host may take.")
    max_parallel: int = Field(16, ge=1, le=256, description="Hosts worked on at the same time.")
    require_gpus: bool = Field(
        True, description="Every host must have a working NVIDIA driver and GPU (false: CPU-only hosts pass)."
    )
    sudo: bool = Field(True, description="Run the commands that change a host via `sudo -n` when user is not root.")
    docker_restart_command: list[str] = Field(
        default_factory=lambda: ["systemctl", "restart", "docker"],
        min_length=1,
        description="argv that restarts docker after its runtime configuration changed.",
    )
    slurm: SlurmJoin | None = Field(
        None,
        description="Join the hosts to this Slurm cluster at bootstrap (dynamic nodes) and take them out at "
        "release; None: no Slurm.",
    )

    @field_validator("hosts")
    @classmethod
    def _unique_names(cls, hosts: list[SshHost]) -> list[SshHost]:
        names = [h.node_name for h in hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"hosts: node names must be unique, {duplicates} repeat; set `name` on the repeats")
        return hosts

    @model_validator(mode="before")
    @classmethod
    def _flat_credentials(cls, data: Any) -> Any:
        return credentials_from_flat(data, "SshHosts", FLAT_CREDENTIAL_FIELDS)

    @model_validator(mode="after")
    def _a_key_to_log_in_with(self) -> SshHosts:
        if self.credentials.private_key is None:
            raise ValueError("credentials.private_key is required: the SSH private key every host accepts")
        return self

    @model_validator(mode="after")
    def _slurm_node_names(self) -> SshHosts:
        if self.slurm is not None:
            bad = [h.node_name for h in self.hosts if not SLURM_NODE_NAME.match(h.node_name)]
            if bad:
                raise ValueError(
                    f"hosts: {bad} are not Slurm node names (a letter, then letters, digits, _ or -); set `name` "
                    "on these hosts (it becomes the Slurm node name)"
                )
        return self

    # ---- NodeProvider --------------------------------------------------------------------

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        """The first ``count`` hosts (bring-your-own: nothing is created)."""
        if count < 1 or count > len(self.hosts):
            raise ConfigurationError(
                f"resources.nodes={count} but this SshHosts block has {len(self.hosts)} host(s) "
                f"({', '.join(h.node_name for h in self.hosts)}): add hosts to the block or lower resources.nodes"
            )
        return [
            Node(
                name=h.node_name,
                provider=self.get_block_type_slug(),
                state=STATE_ACQUIRED,
                labels={"run": key, "address": h.address, "port": str(h.port), "user": self.user_of(h)},
            )
            for h in self.hosts[:count]
        ]

    def inspect(self, nodes: list[Node]) -> list[Node]:
        """Every node with its GPUs, toolkit and docker runtimes, read (not changed) on all at once."""

        def one(node: Node, shell: HostShell) -> Node:
            facts = read_facts(shell)
            return with_facts(node, facts)

        return raise_for_failures("inspect", self._each(nodes, one))

    def host_inventory(self) -> list[Node]:
        """Every host, inspected (nothing is changed or acquired)."""
        return self.inspect(self.acquire(len(self.hosts), NodeRequirements(), "inventory"))

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """The preflight without changing anything: a host whose docker lacks the nvidia runtime fails it."""

        def one(node: Node, shell: HostShell) -> Node:
            facts = read_facts(shell)
            problems = preflight(node.name, facts, requirements, require_gpus=self.require_gpus, fixable_runtime=False)
            if problems:
                raise PreflightFailed("; ".join(problems), with_facts(node, facts))
            return with_facts(node, facts).model_copy(update={"state": STATE_READY})

        return raise_for_failures("preflight", self._each(nodes, one))

    def bootstrap(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """Preflight every node, configure docker's nvidia runtime where missing; all nodes at once."""

        def one(node: Node, shell: HostShell) -> Node:
            facts = read_facts(shell)
            problems = preflight(node.name, facts, requirements, require_gpus=self.require_gpus, fixable_runtime=True)
            if problems:
                raise PreflightFailed("; ".join(problems), with_facts(node, facts))
            changes = []
            if facts.gpus and not facts.nvidia_runtime:
                configure_runtime(node.name, shell, self.docker_restart_command)
                changes.append(
                    "configured docker's nvidia runtime (nvidia-ctk runtime configure --runtime=docker) "
                    f"and restarted docker ({shlex.join(self.docker_restart_command)})"
                )
                facts.runtimes = read_runtimes(shell)[0]
            slurm_labels: dict[str, str] = {}
            if self.slurm is not None:
                slurm_changes, slurm_labels = join_slurm(node.name, shell, facts.gpus, self.slurm)
                changes += slurm_changes
            labels = {"bootstrap": "changed" if changes else "unchanged", **slurm_labels}
            if changes:
                labels["changes"] = "; ".join(changes)
            run_logger("gpuferry.ssh_hosts").info(
                "%s: bootstrap %s%s", node.name, labels["bootstrap"], f" ({labels['changes']})" if changes else ""
            )
            updated = with_facts(node, facts)
            return updated.model_copy(update={"state": STATE_READY, "labels": {**updated.labels, **labels}})

        return raise_for_failures("bootstrap", self._each(nodes, one))

    def release(self, nodes: list[Node]) -> None:
        """Take the nodes out of the Slurm cluster (drain, stop slurmd, delete), when ``slurm`` is set.

        Otherwise nothing to give back: the hosts are yours and stay as they are.
        """
        join = self.slurm
        if join is None:
            return

        def one(node: Node, shell: HostShell) -> Node:
            changes = leave_slurm(node.name, shell, join)
            run_logger("gpuferry.ssh_hosts").info(
                "%s: release %s", node.name, "; ".join(changes) if changes else "(was not in the cluster)"
            )
            return node.model_copy(update={"labels": {**node.labels, "slurm": "left"}})

        raise_for_failures("release", self._each(nodes, one))

    # ---- connections ---------------------------------------------------------------------

    def user_of(self, host: SshHost) -> str:
        """The user ``host`` is logged in as: its own, else the credentials', else root."""
        return host.user or self.credentials.user or "root"

    def _host(self, node: Node) -> SshHost:
        for host in self.hosts:
            if host.node_name == node.name:
                return host
        raise ConfigurationError(
            f"node {node.name!r} is not one of this block's hosts ({', '.join(h.node_name for h in self.hosts)})"
        )

    def _each(
        self, nodes: list[Node], step: Callable[[Node, HostShell], Node]
    ) -> list[tuple[Node, BaseException | None]]:
        """Run ``step`` on every node at once; every node's outcome, failures included, in input order."""
        if not nodes:
            return []
        key, known = self.credentials.key(), self.credentials.host_keys()
        hosts = [self._host(n) for n in nodes]

        def run(node: Node, host: SshHost) -> Node:
            shell = self._connect(host, key, known)
            try:
                return step(node, shell)
            finally:
                shell.close()

        outcomes: list[tuple[Node, BaseException | None]] = []
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(nodes)), thread_name_prefix="ssh-host") as pool:
            futures = [pool.submit(run, node, host) for node, host in zip(nodes, hosts, strict=True)]
            for node, future in zip(nodes, futures, strict=True):
                try:
                    outcomes.append((future.result(), None))
                except Exception as exc:  # noqa: BLE001 - every node's outcome is reported
                    state = STATE_UNREACHABLE if isinstance(exc, TransientError) else STATE_FAILED
                    if not isinstance(exc, GpuferryError):
                        exc = GpuferryError(f"{node.name}: {type(exc).__name__}: {exc}")
                    run_logger("gpuferry.ssh_hosts").error(
                        "%s", exc if str(exc).startswith(node.name) else f"{node.name}: {exc}"
                    )
                    seen = exc.node if isinstance(exc, PreflightFailed) else node  # with what was read from it
                    failed = seen.model_copy(update={"state": state, "labels": {**seen.labels, "error": str(exc)}})
                    outcomes.append((failed, exc))
        return outcomes

    def _connect(self, host: SshHost, key: paramiko.PKey, known: paramiko.HostKeys) -> HostShell:
        """A connection to ``host``; connection failures are retried with exponential backoff."""
        session = SshSession(
            self.credentials,
            host.address,
            host.port,
            user=self.user_of(host),
            connect_timeout=self.connect_timeout,
            command_timeout=self.command_timeout,
            name=f"{host.node_name} ({host.known_hosts_name})",
            check_against="is the host's own: compare with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
            "on its console",
            key=key,
            known=known,
        )
        started = time.monotonic()

        def warn(state: RetryCallState) -> None:
            run_logger("gpuferry.ssh_hosts").warning(
                "%s: connection attempt %d/%d failed (%s); retrying in %.1f s",
                host.node_name,
                state.attempt_number,
                self.connect_attempts,
                state.outcome.exception() if state.outcome else "?",
                state.upcoming_sleep,
            )

        connect = Retrying(  # sshd may still be starting: the exponential wait gives it time
            retry=retry_if_exception_type(TRANSPORT_ERRORS),
            stop=stop_after_attempt(self.connect_attempts),
            wait=wait_exponential(multiplier=self.retry_backoff_seconds, exp_base=2),
            before_sleep=warn,
            reraise=True,
        )
        try:
            connect(session.client)
        except ConfigurationError as exc:
            if host.node_name in str(exc):
                raise
            raise ConfigurationError(f"{host.node_name}: {exc}") from exc
        except TRANSPORT_ERRORS as exc:
            raise TransientError(
                f"{host.node_name} is unreachable: {self.connect_attempts} connection attempt(s) to "
                f"{self.user_of(host)}@{host.address}:{host.port} over {time.monotonic() - started:.1f} s failed, "
                f"the last with: {str(exc) or type(exc).__name__}. Fix: check that the host is up, that sshd listens "
                f"on port {host.port} and that the network lets this machine reach it; or remove the host from the "
                "block"
            ) from exc
        return HostShell(session, host.node_name, sudo=self.sudo)

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """SSH reach, host key and login of every host (``blocks/slurm/check.py``); nothing is changed."""
        from blocks.hosts.check import check_ssh_hosts

        check_ssh_hosts(self, probe)
        return probe.rows
