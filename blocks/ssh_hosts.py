"""Bring your own GPU nodes: hosts reached over SSH, checked and set up in parallel.

``SshHosts`` is a ``NodeProvider`` over a fixed list of hosts. ``acquire(count)`` hands out the first
``count`` of them (there is nothing to create). Every host's SSH host key is checked against the
block's ``known_hosts`` content: an unknown or changed key is refused, never added, and the error
names the host, the fingerprint it offered and the fix. Every command is an argv list joined with
``shlex.quote``.

``inspect(nodes)`` reads, on every node at once (one thread each, up to ``max_parallel``):

* ``nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits``
  and the banner of plain ``nvidia-smi`` (CUDA version);
* ``nvidia-ctk --version`` (NVIDIA Container Toolkit);
* ``docker info --format '{{json .Runtimes}}'``: is docker configured with the ``nvidia`` runtime?

``bootstrap(nodes, requirements)`` runs the preflight (GPUs against the job's minimums, the toolkit
present, docker answering) and then, only where docker lacks the ``nvidia`` runtime, runs
``nvidia-ctk runtime configure --runtime=docker`` and restarts docker, and reads the runtimes back
to confirm. Each node reports ``labels["bootstrap"]`` = ``changed`` (with ``labels["changes"]``)
or ``unchanged``: a second run changes nothing. Nodes are set up independently: a host that fails
(preflight, or unreachable after ``connect_attempts`` tries with exponential backoff) does not stop
the others; once all finished, ``NodesFailed``/``NodesUnreachable`` lists the failed hosts and
carries every node's outcome (``Node.state``: ready, failed, unreachable).

``release(nodes)`` gives nothing back: the hosts are yours and stay as they are.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from blocks._ssh import fingerprint, load_private_key
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.provision import (
    NVIDIA_SMI_QUERY,
    STATE_ACQUIRED,
    STATE_FAILED,
    STATE_READY,
    STATE_UNREACHABLE,
    NodeProvider,
    NodeRequirements,
    check_node,
    parse_cuda_version,
    parse_nvidia_smi,
    raise_for_failures,
)
from blocks.specs import GpuInfo, Node

EXIT_NOT_FOUND = 127  # the shell's "command not found"
DOCKER_RUNTIMES = ["docker", "info", "--format", "{{json .Runtimes}}"]
CONFIGURE_RUNTIME = ["nvidia-ctk", "runtime", "configure", "--runtime=docker"]
_CTK_VERSION = re.compile(r"version\s+v?([0-9][0-9A-Za-z.+~-]*)")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("gpuferry.ssh_hosts")




class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise ConfigurationError(
            f"the SSH host key of {hostname} is not in known_hosts (it offered {key.get_name()} {fingerprint(key)}); "
            "refusing to connect. Fix: run `ssh-keyscan -p PORT ADDRESS`, check that the fingerprint "
            "(`ssh-keygen -lf -` on its output) is the host's own (compare with `ssh-keygen -lf "
            "/etc/ssh/ssh_host_ed25519_key.pub` on its console), and add the line to the block's known_hosts"
        )


class SshHost(BaseModel):
    """One host of an ``SshHosts`` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(min_length=1, description="IP address or DNS name the host is reached at.")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str = Field("root", min_length=1, description="SSH user (root, or a user allowed `sudo -n`).")
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


@dataclass
class _Facts:
    """What one host has, read without changing anything."""

    gpus: list[GpuInfo] = field(default_factory=list)
    gpu_problem: str | None = None
    toolkit: str | None = None
    toolkit_problem: str | None = None
    runtimes: list[str] = field(default_factory=list)
    docker_problem: str | None = None
    cpus: int = 0
    memory_mib: int = 0

    @property
    def nvidia_runtime(self) -> bool:
        return "nvidia" in self.runtimes


class _Session:
    """One SSH connection to one host; commands are argv lists."""

    def __init__(self, client: paramiko.SSHClient, host: SshHost, timeout: float, sudo: bool) -> None:
        self.client, self.host, self.timeout, self.sudo = client, host, timeout, sudo

    def run(self, argv: Sequence[str], *, change: bool = False) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); ``change``: a command that changes the host (via sudo -n when not root)."""
        return self.run_all([argv], change=change)[0]

    def run_all(self, argvs: Sequence[Sequence[str]], *, change: bool = False) -> list[tuple[int, str, str]]:
        """Several commands at once, one SSH channel each (login shells can be slow to start)."""
        commands = [list(a) for a in argvs]
        if change and self.sudo and self.host.user != "root":
            commands = [["sudo", "-n", "--", *a] for a in commands]
        channels = []
        try:
            transport = self.client.get_transport()
            if transport is None or not transport.is_active():
                raise EOFError("the SSH connection is closed")
            for argv in commands:
                channel = transport.open_session(timeout=self.timeout)
                channels.append(channel)
                channel.settimeout(self.timeout)
                channel.exec_command(shlex.join(argv))
            results = []
            for channel in channels:
                stdout = channel.makefile("rb").read().decode("utf-8", "replace")
                stderr = channel.makefile_stderr("rb").read().decode("utf-8", "replace")
                results.append((channel.recv_exit_status(), stdout, stderr))
            return results
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise TransientError(
                f"{self.host.node_name}: the SSH connection failed running "
                f"{', '.join(a[0] for a in commands)}: {exc or type(exc).__name__}"
            ) from exc
        finally:
            for channel in channels:
                channel.close()

    def check(self, argv: Sequence[str], what: str, fix: str, *, change: bool = False) -> str:
        rc, out, err = self.run(argv, change=change)
        if rc != 0:
            raise ConfigurationError(
                f"{self.host.node_name}: {what} failed (`{shlex.join(argv)}` exit {rc}: "
                f"{(err or out).strip()[-500:] or 'no output'}). Fix: {fix}"
            )
        return out

    def close(self) -> None:
        self.client.close()


class _PreflightFailed(ConfigurationError):
    """A node failed its preflight; ``node`` is the node with what was read from it."""

    def __init__(self, message: str, node: Node) -> None:
        super().__init__(message)
        self.node = node


def _problem(node: str, check: str, detail: str, fix: str) -> str:
    return f"{node}: preflight check '{check}' failed: {detail}. Fix: {fix}"


class SshHosts(NodeProvider):
    """Your own GPU hosts over SSH (verified host keys), checked and bootstrapped in parallel."""

    _block_type_name = "gpuferry SSH Hosts"
    _description = (
        "Bring-your-own GPU hosts reached over SSH: checks GPUs, driver, CUDA and the NVIDIA Container Toolkit, "
        "and configures docker's nvidia runtime where it is missing, on all hosts at once."
    )

    hosts: list[SshHost] = Field(min_length=1, description="The hosts (address, port, user, optional name).")
    private_key: SecretStr = Field(description="SSH private key for every host (OpenSSH or PEM text).")
    private_key_passphrase: SecretStr | None = Field(None, description="Passphrase of the private key, if any.")
    known_hosts: str = Field(
        description="known_hosts lines of every host (`ssh-keyscan -p PORT ADDRESS`); unknown or changed keys "
        "are refused."
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

    @field_validator("hosts")
    @classmethod
    def _unique_names(cls, hosts: list[SshHost]) -> list[SshHost]:
        names = [h.node_name for h in hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"hosts: node names must be unique, {duplicates} repeat; set `name` on the repeats")
        return hosts

    # ---- NodeProvider --------------------------------------------------------------------

    def acquire(self, count: int, requirements: NodeRequirements, key: str) -> list[Node]:
        """The first ``count`` hosts (bring-your-own: nothing is created)."""
        if count < 1 or count > len(self.hosts):
            raise ConfigurationError(
                f"resources.nodes={count} but this SshHosts block has {len(self.hosts)} host(s) "
                f"({', '.join(h.node_name for h in self.hosts)}): add hosts to the block or lower resources.nodes"
            )
        return [
            Node(name=h.node_name, provider=self.get_block_type_slug(), state=STATE_ACQUIRED,
                 labels={"run": key, "address": h.address, "port": str(h.port), "user": h.user})
            for h in self.hosts[:count]
        ]  # fmt: skip

    def inspect(self, nodes: list[Node]) -> list[Node]:
        """Every node with its GPUs, toolkit and docker runtimes, read (not changed) on all at once."""

        def one(node: Node, session: _Session) -> Node:
            facts = self._facts(session)
            return self._with_facts(node, facts)

        return raise_for_failures("inspect", self._each(nodes, one))

    def check(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """The preflight without changing anything: a host whose docker lacks the nvidia runtime fails it."""

        def one(node: Node, session: _Session) -> Node:
            facts = self._facts(session)
            problems = self._preflight(node.name, facts, requirements, fixable_runtime=False)
            if problems:
                raise _PreflightFailed("; ".join(problems), self._with_facts(node, facts))
            return self._with_facts(node, facts).model_copy(update={"state": STATE_READY})

        return raise_for_failures("preflight", self._each(nodes, one))

    def bootstrap(self, nodes: list[Node], requirements: NodeRequirements) -> list[Node]:
        """Preflight every node, configure docker's nvidia runtime where missing; all nodes at once."""

        def one(node: Node, session: _Session) -> Node:
            facts = self._facts(session)
            problems = self._preflight(node.name, facts, requirements, fixable_runtime=True)
            if problems:
                raise _PreflightFailed("; ".join(problems), self._with_facts(node, facts))
            changes = []
            if facts.gpus and not facts.nvidia_runtime:
                self._configure_runtime(node.name, session)
                changes.append("configured docker's nvidia runtime (nvidia-ctk runtime configure --runtime=docker) "
                               f"and restarted docker ({shlex.join(self.docker_restart_command)})")  # fmt: skip
                facts.runtimes = self._runtimes(session)[0]
            labels = {"bootstrap": "changed" if changes else "unchanged"}
            if changes:
                labels["changes"] = "; ".join(changes)
            _logger().info("%s: bootstrap %s%s", node.name, labels["bootstrap"],
                           f" ({labels['changes']})" if changes else "")  # fmt: skip
            updated = self._with_facts(node, facts)
            return updated.model_copy(update={"state": STATE_READY, "labels": {**updated.labels, **labels}})

        return raise_for_failures("bootstrap", self._each(nodes, one))

    def release(self, nodes: list[Node]) -> None:
        """Nothing to give back: the hosts are yours and stay as they are."""

    # ---- steps ---------------------------------------------------------------------------

    def _facts(self, s: _Session) -> _Facts:
        facts = _Facts()
        query, banner, ctk, runtimes, nproc, meminfo = s.run_all([
            ["nvidia-smi", *NVIDIA_SMI_QUERY], ["nvidia-smi"], ["nvidia-ctk", "--version"], DOCKER_RUNTIMES,
            ["getconf", "_NPROCESSORS_ONLN"], ["cat", "/proc/meminfo"],
        ])  # fmt: skip
        rc, out, err = query
        if rc == EXIT_NOT_FOUND:
            facts.gpu_problem = "nvidia-smi not found (no NVIDIA driver installed)"
        elif rc != 0:
            facts.gpu_problem = f"nvidia-smi failed (exit {rc}): {(err or out).strip()[-300:]}"
        else:
            try:
                facts.gpus = parse_nvidia_smi(out, parse_cuda_version(banner[1]))
            except ValueError as exc:
                facts.gpu_problem = f"nvidia-smi printed something unexpected ({exc}): {out.strip()[:200]!r}"
            if not facts.gpus and not facts.gpu_problem:
                facts.gpu_problem = "nvidia-smi lists no GPU"
        rc, out, err = ctk
        match = _CTK_VERSION.search(out) if rc == 0 else None
        if match:
            facts.toolkit = match.group(1)
        elif rc == EXIT_NOT_FOUND:
            facts.toolkit_problem = "nvidia-ctk not found (the NVIDIA Container Toolkit is not installed)"
        else:
            facts.toolkit_problem = f"`nvidia-ctk --version` failed (exit {rc}): {(err or out).strip()[-300:]}"
        facts.runtimes, facts.docker_problem = self._parse_runtimes(*runtimes)
        rc, out, _ = nproc
        facts.cpus = int(out.strip()) if rc == 0 and out.strip().isdigit() else 0
        rc, out, _ = meminfo
        mem = re.search(r"^MemTotal:\s+(\d+)\s+kB", out, re.M) if rc == 0 else None
        facts.memory_mib = int(mem.group(1)) // 1024 if mem else 0
        return facts

    def _runtimes(self, s: _Session) -> tuple[list[str], str | None]:
        return self._parse_runtimes(*s.run(DOCKER_RUNTIMES))

    @staticmethod
    def _parse_runtimes(rc: int, out: str, err: str) -> tuple[list[str], str | None]:
        if rc == EXIT_NOT_FOUND:
            return [], "docker not found (Docker Engine is not installed)"
        if rc != 0:
            return [], f"`docker info` failed (exit {rc}): {(err or out).strip()[-300:]}"
        try:
            runtimes = json.loads(out)
        except json.JSONDecodeError:
            return [], f"`docker info` printed no runtime list: {out.strip()[:200]!r}"
        return sorted(runtimes) if isinstance(runtimes, dict) else [], None

    def _preflight(
        self, node: str, facts: _Facts, requirements: NodeRequirements, *, fixable_runtime: bool
    ) -> list[str]:
        problems = []
        needs_gpus = self.require_gpus or requirements.gpus > 0
        if facts.gpu_problem and needs_gpus:
            fix = "install the NVIDIA driver on the host, or remove the host from the block"
            problems.append(_problem(node, "nvidia-smi", facts.gpu_problem, fix))
        problems += [p.replace(f"{node}: ", f"{node}: preflight check 'gpus' failed: ", 1)
                     for p in check_node(Node(name=node, provider="", gpus=facts.gpus), requirements)]  # fmt: skip
        if facts.gpus:
            if facts.toolkit_problem:
                fix = "install nvidia-container-toolkit (NVIDIA's apt/yum repository) on the host"
                problems.append(_problem(node, "nvidia-ctk", facts.toolkit_problem, fix))
            if facts.docker_problem:
                problems.append(_problem(node, "docker", facts.docker_problem,
                                         "install Docker Engine and start it (systemctl start docker)"))  # fmt: skip
            elif not facts.nvidia_runtime and not fixable_runtime:
                found = f"docker has no nvidia runtime (runtimes: {', '.join(facts.runtimes) or 'none'})"
                fix = "run bootstrap, or `nvidia-ctk runtime configure --runtime=docker` and restart docker"
                problems.append(_problem(node, "docker-nvidia-runtime", found, fix))
        return problems

    def _configure_runtime(self, node: str, s: _Session) -> None:
        s.check(CONFIGURE_RUNTIME, "configuring docker's nvidia runtime",
                "run it by hand on the host and read its output (it needs root, or sudo -n)", change=True)  # fmt: skip
        s.check(self.docker_restart_command, "restarting docker",
                "set docker_restart_command to how docker is restarted on the host", change=True)  # fmt: skip
        runtimes, problem = self._runtimes(s)
        if "nvidia" not in runtimes:
            raise ConfigurationError(
                f"{node}: docker still has no nvidia runtime after `{shlex.join(CONFIGURE_RUNTIME)}` and a restart "
                f"({problem or 'runtimes: ' + (', '.join(runtimes) or 'none')}). Fix: check /etc/docker/daemon.json "
                "on the host and that docker_restart_command really restarts docker"
            )

    @staticmethod
    def _with_facts(node: Node, facts: _Facts) -> Node:
        labels = dict(node.labels)
        labels["toolkit"] = facts.toolkit or "missing"
        labels["container_runtime"] = (
            "docker (nvidia)" if facts.nvidia_runtime else "docker" if not facts.docker_problem else "missing"
        )
        return node.model_copy(update={"gpus": facts.gpus, "cpus": facts.cpus, "memory_mib": facts.memory_mib,
                                       "labels": labels})  # fmt: skip

    # ---- connections ---------------------------------------------------------------------

    def _host(self, node: Node) -> SshHost:
        for host in self.hosts:
            if host.node_name == node.name:
                return host
        raise ConfigurationError(
            f"node {node.name!r} is not one of this block's hosts ({', '.join(h.node_name for h in self.hosts)})"
        )

    def _each(
        self, nodes: list[Node], step: Callable[[Node, _Session], Node]
    ) -> list[tuple[Node, BaseException | None]]:
        """Run ``step`` on every node at once; every node's outcome, failures included, in input order."""
        if not nodes:
            return []
        key = load_private_key(
            self.private_key.get_secret_value(),
            self.private_key_passphrase.get_secret_value() if self.private_key_passphrase else None,
        )
        known = self._host_keys()
        hosts = [self._host(n) for n in nodes]

        def run(node: Node, host: SshHost) -> Node:
            session = self._connect(host, key, known)
            try:
                return step(node, session)
            finally:
                session.close()

        outcomes: list[tuple[Node, BaseException | None]] = []
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(nodes)), thread_name_prefix="ssh-host") as pool:
            futures = [pool.submit(run, node, host) for node, host in zip(nodes, hosts)]
            for node, future in zip(nodes, futures):
                try:
                    outcomes.append((future.result(), None))
                except Exception as exc:  # noqa: BLE001 - every node's outcome is reported
                    state = STATE_UNREACHABLE if isinstance(exc, TransientError) else STATE_FAILED
                    if not isinstance(exc, GpuferryError):
                        exc = GpuferryError(f"{node.name}: {type(exc).__name__}: {exc}")
                    _logger().error("%s", exc if str(exc).startswith(node.name) else f"{node.name}: {exc}")
                    seen = exc.node if isinstance(exc, _PreflightFailed) else node  # with what was read from it
                    failed = seen.model_copy(update={"state": state, "labels": {**seen.labels, "error": str(exc)}})
                    outcomes.append((failed, exc))
        return outcomes

    def _host_keys(self) -> paramiko.HostKeys:
        keys = paramiko.HostKeys()
        for number, line in enumerate(self.known_hosts.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
                except (paramiko.SSHException, ValueError) as exc:
                    raise ConfigurationError(f"known_hosts line {number} is not a known_hosts entry: {exc}") from exc
                if entry is None:
                    raise ConfigurationError(f"known_hosts line {number} is not a known_hosts entry: {line[:80]!r}")
                for name in entry.hostnames:
                    keys.add(name, entry.key.get_name(), entry.key)
        return keys

    def _connect(self, host: SshHost, key: paramiko.PKey, known: paramiko.HostKeys) -> _Session:
        """A connection to ``host``; connection failures are retried with exponential backoff."""
        started = time.monotonic()
        last: BaseException | None = None
        for attempt in range(1, self.connect_attempts + 1):
            try:
                return _Session(self._connect_once(host, key, known), host, self.command_timeout, self.sudo)
            except TransientError as exc:
                last = exc
                if attempt < self.connect_attempts:
                    delay = self.retry_backoff_seconds * 2 ** (attempt - 1)
                    _logger().warning("%s: connection attempt %d/%d failed (%s); retrying in %.1f s",
                                      host.node_name, attempt, self.connect_attempts, exc, delay)  # fmt: skip
                    time.sleep(delay)
        raise TransientError(
            f"{host.node_name} is unreachable: {self.connect_attempts} connection attempt(s) to "
            f"{host.user}@{host.address}:{host.port} over {time.monotonic() - started:.1f} s failed, the last with: "
            f"{last}. Fix: check that the host is up, that sshd listens on port {host.port} and that the network "
            "lets this machine reach it; or remove the host from the block"
        )

    def _connect_once(self, host: SshHost, key: paramiko.PKey, known: paramiko.HostKeys) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        host_keys = client.get_host_keys()
        for name in known.keys():
            for key_type, host_key in known.lookup(name).items():
                host_keys.add(name, key_type, host_key)
        client.set_missing_host_key_policy(_RefuseUnknownHost())
        try:
            client.connect(
                host.address, port=host.port, username=host.user, pkey=key, timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
                look_for_keys=False, allow_agent=False,
            )  # fmt: skip
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise ConfigurationError(
                f"the SSH host key of {host.node_name} ({host.known_hosts_name}) CHANGED: known_hosts has "
                f"{exc.expected_key.get_name()} {fingerprint(exc.expected_key)}, the host offered "
                f"{exc.key.get_name()} {fingerprint(exc.key)}; refusing to connect. This is a reinstalled host or "
                "someone in between: confirm the new fingerprint on the host's console (`ssh-keygen -lf "
                "/etc/ssh/ssh_host_ed25519_key.pub`), then replace its line in known_hosts"
            ) from exc
        except paramiko.AuthenticationException as exc:
            client.close()
            raise ConfigurationError(
                f"{host.node_name}: SSH login as {host.user}@{host.address}:{host.port} was refused ({exc}): check "
                "user and private_key, and that the public key is in the user's authorized_keys"
            ) from exc
        except GpuferryError as exc:
            client.close()
            raise ConfigurationError(f"{host.node_name}: {exc}") from exc
        except (OSError, EOFError, paramiko.SSHException) as exc:
            client.close()
            raise TransientError(str(exc) or type(exc).__name__) from exc
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(30)
        return client
