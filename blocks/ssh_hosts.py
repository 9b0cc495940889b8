"""Bring your own GPU nodes: hosts reached over SSH, checked and set up in parallel.

``SshHosts`` is a ``NodeProvider`` over a fixed list of hosts. ``acquire(count)`` hands out the first
``count`` of them (there is nothing to create). Every host's SSH host key is checked against the
block's ``known_hosts`` content: an unknown or changed key is refused, never added, and the error
names the host, the fingerprint it offered and the fix. Every command is an argv list joined with
``shlex.quote``.

``inspect(nodes)`` reads, on every node at once (one thread each, up to ``max_parallel``):

* ``nvidia-smi --query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader,nounits``
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

With ``slurm`` set (a ``SlurmJoin``), bootstrap also joins every node to a Slurm cluster as a
dynamic node (Slurm >= 22.05), each step checking first:

* the cluster's MUNGE key (compared by SHA-256; sent on stdin, never on a command line), then
  ``munge_restart_command``;
* the cluster's ``slurm.conf`` (and ``cgroup.conf``) unchanged, and its ``gres.conf`` plus this
  node's GPU lines (one ``NodeName=<node> Name=gpu Type=<model> File=<device>`` per GPU of the
  node's ``nvidia-smi`` inventory), all into ``conf_dir``;
* ``slurmd -f <conf_dir>/slurm.conf -N <node> -Z --conf "Gres=gpu:<model>:<n> Feature=<features>"``
  unless a slurmd with exactly that command line runs (pid file from ``SlurmdPidFile``); one with
  another command line, or config files that changed, is restarted;
* the node registered (``scontrol show node``, polled until ``registration_timeout_seconds``) and
  usable: a drained or down node is resumed.

The cluster must take dynamic nodes: ``MaxNodeCount`` in its slurm.conf and a controller address
the nodes reach (``SlurmctldHost=name(address)``); the node's address is taken from its
registration. A partition can collect the joined nodes by feature (``NodeSet=x Feature=x`` and
``PartitionName=... Nodes=x``). ``release(nodes)`` then drains each node, waits (up to
``drain_timeout_seconds``) until its jobs are gone, stops its slurmd and deletes it from the
cluster (``scontrol delete nodename``); releasing twice is harmless. Without ``slurm``, release
gives nothing back: the hosts are yours and stay as they are.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import posixpath
import re
import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from blocks._ssh import connect_verified, load_private_key, parse_known_hosts
from blocks.backoff import Poll, retry_delay
from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError, GpuferryError, TransientError
from blocks.provision import (
    NVIDIA_SMI_QUERY,
    TOOLKIT_MISSING,
    STATE_ACQUIRED,
    STATE_FAILED,
    STATE_READY,
    STATE_UNREACHABLE,
    NodeProvider,
    NodeRequirements,
    check_node,
    parse_ctk_version,
    parse_cuda_version,
    parse_nvidia_smi,
    raise_for_failures,
)
from blocks.specs import GpuInfo, Node

EXIT_NOT_FOUND = 127  # the shell's "command not found"
DOCKER_RUNTIMES = ["docker", "info", "--format", "{{json .Runtimes}}"]
CONFIGURE_RUNTIME = ["nvidia-ctk", "runtime", "configure", "--runtime=docker"]
SLURM_NODE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.-]+$")
_RELEASE_REASON = "released by gpuferry"

# Prints the command line (one argument a line) of the slurmd whose pid is in $1; exit 3: none runs.
_SLURMD_RUNNING = r"""pidfile=$1
[ -s "$pidfile" ] || exit 3
pid=$(cat "$pidfile")
[ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] || exit 3
tr '\0' '\n' <"/proc/$pid/cmdline"
"""
# Stops the slurmd whose pid is in $1 (SIGTERM, SIGKILL after 30 s); nothing to do when none runs.
_SLURMD_STOP = r"""pidfile=$1
[ -s "$pidfile" ] || exit 0
pid=$(cat "$pidfile")
[ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] || exit 0
kill "$pid" 2>/dev/null || exit 0
i=0
while [ -n "$(tr -d '\0' <"/proc/$pid/cmdline" 2>/dev/null)" ]; do
  i=$((i + 1))
  if [ "$i" -gt 300 ]; then
    kill -9 "$pid" 2>/dev/null; echo "slurmd $pid ignored SIGTERM for 30 s: killed" >&2; break
  fi
  sleep 0.1
done
"""


def gres_type(gpu_name: str) -> str:
    """A GRES type for a GPU model, as Slurm's NVML detection names it ('NVIDIA A100-SXM4-80GB': a100-sxm4-80gb)."""
    name = gpu_name.strip().lower()
    name = re.sub(r"^nvidia\s+", "", name)
    return re.sub(r"[^a-z0-9.-]+", "_", name).strip("_") or "gpu"


def _conf_value(conf: str, key: str) -> str | None:
    """The value of ``key=value`` in slurm.conf text (keys are case-insensitive; the last one counts)."""
    value = None
    for line in conf.splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, rest = line.partition("=")
        if sep and name.strip().lower() == key.lower():
            value = rest.strip().split()[0] if rest.strip() else ""
    return value


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SlurmJoin(BaseModel):
    """How ``SshHosts`` joins its hosts to a Slurm cluster at bootstrap and takes them out at release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slurm_conf: str = Field(
        min_length=1, description="The cluster's slurm.conf (its content), installed unchanged on every node."
    )
    gres_conf: str = Field("", description="The cluster's gres.conf (content); each node's own GPU lines are added.")
    cgroup_conf: str | None = Field(
        None, description="The cluster's cgroup.conf (content), installed unchanged; needed where slurm.conf uses "
        "cgroup plugins (proctrack/cgroup, task/cgroup). None: not written."
    )  # fmt: skip
    munge_key: SecretStr | None = Field(
        None, description="The cluster's MUNGE key, base64 (`base64 -w0 /etc/munge/munge.key`); None: the nodes "
        "already have it."
    )  # fmt: skip
    features: list[str] = Field(
        default_factory=list, description="Features of the joined nodes (a partition's NodeSet may select them)."
    )
    conf_dir: str = Field(
        "/etc/slurm", description="Directory of slurm.conf and gres.conf on the nodes ({node}: the node's name, for "
        "hosts that share a filesystem)."
    )  # fmt: skip
    munge_key_path: str = Field(
        "/etc/munge/munge.key", description="Where munged reads its key on the nodes ({node}: the node's name)."
    )
    munge_user: str = Field("munge", description="Owner of the MUNGE key file.")
    munge_restart_command: list[str] = Field(
        default_factory=lambda: ["systemctl", "restart", "munge"], min_length=1,
        description="argv that restarts munged after its key changed.",
    )  # fmt: skip
    gpu_device: str = Field(
        "/dev/nvidia{index}",
        description="Device file of the GPU with nvidia-smi index {index} (gres.conf File=; {node}: the node's name).",
    )
    slurmd: str = Field("slurmd", min_length=1, description="slurmd command on the nodes.")
    scontrol: str = Field("scontrol", min_length=1, description="scontrol command on the nodes.")
    registration_timeout_seconds: float = Field(
        120.0, gt=0, description="How long bootstrap waits for a node to register and become usable."
    )
    drain_timeout_seconds: float = Field(
        600.0, gt=0, description="How long release waits for the jobs on a draining node to end."
    )

    @field_validator("slurm_conf")
    @classmethod
    def _dynamic_nodes_possible(cls, conf: str) -> str:
        if not (_conf_value(conf, "SlurmctldHost") or _conf_value(conf, "ControlMachine")):
            raise ValueError("slurm.slurm_conf has no SlurmctldHost: give the cluster's whole slurm.conf")
        if not _conf_value(conf, "MaxNodeCount"):
            raise ValueError(
                "slurm.slurm_conf has no MaxNodeCount: the cluster does not take dynamic nodes; add "
                "MaxNodeCount=<static nodes + nodes that may join> to its slurm.conf and restart slurmctld"
            )
        if "%h" in (_conf_value(conf, "SlurmdPidFile") or ""):
            raise ValueError("slurm.slurm_conf: SlurmdPidFile with %h is not supported here; use %n (the node name)")
        return conf

    @field_validator("munge_key")
    @classmethod
    def _base64_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is None:
            return None
        try:
            raw = base64.b64decode(key.get_secret_value(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("slurm.munge_key is not base64: give `base64 -w0 /etc/munge/munge.key`") from exc
        if len(raw) < 32:
            raise ValueError(f"slurm.munge_key is {len(raw)} bytes; munged needs at least 32 (mungekey makes 128)")
        return key

    @field_validator("features")
    @classmethod
    def _feature_names(cls, features: list[str]) -> list[str]:
        bad = [f for f in features if not _SLURM_WORD.match(f)]
        if bad:
            raise ValueError(f"slurm.features: {bad} are not Slurm feature names (letters, digits, _ . -)")
        return features

    @field_validator("gpu_device")
    @classmethod
    def _indexed(cls, value: str) -> str:
        if "{index}" not in value:
            raise ValueError("slurm.gpu_device must contain {index} (e.g. /dev/nvidia{index})")
        return value

    def conf_path(self, node: str) -> str:
        return posixpath.join(self.conf_dir.replace("{node}", node), "slurm.conf")

    def gres_path(self, node: str) -> str:
        return posixpath.join(self.conf_dir.replace("{node}", node), "gres.conf")

    def config_files(self, node: str, gpus: Sequence[GpuInfo]) -> dict[str, str]:
        """path -> content of every config file the node gets."""
        files = {self.conf_path(node): self.slurm_conf, self.gres_path(node): self.gres_conf_for(node, gpus)}
        if self.cgroup_conf is not None:
            files[posixpath.join(self.conf_dir.replace("{node}", node), "cgroup.conf")] = self.cgroup_conf
        return {path: text if text.endswith("\n") else text + "\n" for path, text in files.items()}

    def key_path(self, node: str) -> str:
        return self.munge_key_path.replace("{node}", node)

    def pid_file(self, node: str) -> str:
        return (_conf_value(self.slurm_conf, "SlurmdPidFile") or "/var/run/slurmd.pid").replace("%n", node)

    def node_gres(self, node: str, gpus: Sequence[GpuInfo]) -> tuple[str, list[str]]:
        """(the Gres= value, the gres.conf lines) of a node with these GPUs."""
        counts: dict[str, int] = {}
        lines = []
        for gpu in sorted(gpus, key=lambda g: g.index):
            kind = gres_type(gpu.name)
            counts[kind] = counts.get(kind, 0) + 1
            device = self.gpu_device.replace("{node}", node).replace("{index}", str(gpu.index))
            lines.append(f"NodeName={node} Name=gpu Type={kind} File={device}")
        return ",".join(f"gpu:{kind}:{n}" for kind, n in counts.items()), lines

    def gres_conf_for(self, node: str, gpus: Sequence[GpuInfo]) -> str:
        _, lines = self.node_gres(node, gpus)
        head = self.gres_conf.rstrip("\n")
        own = "\n".join([f"# {node}: its GPUs (written at bootstrap)", *lines]) if lines else ""
        return "\n".join(part for part in (head, own) if part) + "\n"

    def slurmd_argv(self, node: str, gpus: Sequence[GpuInfo]) -> list[str]:
        gres, _ = self.node_gres(node, gpus)
        conf = " ".join(p for p in (f"Gres={gres}" if gres else "",
                                    f"Feature={','.join(self.features)}" if self.features else "") if p)  # fmt: skip
        return [self.slurmd, "-f", self.conf_path(node), "-N", node, "-Z", *(["--conf", conf] if conf else [])]

    def scontrol_argv(self, node: str, *args: str) -> list[str]:
        return ["env", f"SLURM_CONF={self.conf_path(node)}", self.scontrol, *args]


@dataclass
class _SlurmNode:
    """What ``scontrol show node`` says about one node."""

    base: str  # IDLE, MIXED, ALLOCATED, DOWN, ...
    flags: set[str]  # DRAIN, NOT_RESPONDING, DYNAMIC_NORM, ...
    fields: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> _SlurmNode:
        fields = dict(re.findall(r"(\w+)=(\S*)", text))
        state = fields.get("State", "UNKNOWN")
        parts = state.split("+")
        flags = set(parts[1:])
        if parts[0].endswith("*"):
            flags.add("NOT_RESPONDING")
        return cls(parts[0].rstrip("*~#!%$@^-"), flags, fields)

    @property
    def state(self) -> str:
        return self.fields.get("State", "UNKNOWN")

    @property
    def usable(self) -> bool:
        return self.base in ("IDLE", "MIXED", "ALLOCATED", "COMPLETING") and not (
            self.flags & {"DRAIN", "NOT_RESPONDING", "FAIL", "INVALID_REG", "POWERED_DOWN", "POWERING_DOWN"}
        )

    @property
    def drained(self) -> bool:
        """Drained and no job left on it."""
        return "DRAIN" in self.flags and self.base in ("IDLE", "DOWN") and "COMPLETING" not in self.flags


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("gpuferry.ssh_hosts")




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

    def run(self, argv: Sequence[str], *, change: bool = False, stdin: bytes | None = None) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); ``change``: a command that changes the host (via sudo -n when not root);
        ``stdin``: bytes written to the command's standard input (how secrets reach a host)."""
        return self.run_all([argv], change=change, stdin=stdin)[0]

    def run_all(
        self, argvs: Sequence[Sequence[str]], *, change: bool = False, stdin: bytes | None = None
    ) -> list[tuple[int, str, str]]:
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
                if stdin is not None:
                    channel.sendall(stdin)
                channel.shutdown_write()
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

    def check(
        self, argv: Sequence[str], what: str, fix: str, *, change: bool = False, stdin: bytes | None = None
    ) -> str:
        rc, out, err = self.run(argv, change=change, stdin=stdin)
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
        "configures docker's nvidia runtime where it is missing and joins the hosts to a Slurm cluster, on all "
        "hosts at once."
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
    slurm: SlurmJoin | None = Field(
        None, description="Join the hosts to this Slurm cluster at bootstrap (dynamic nodes) and take them out at "
        "release; None: no Slurm."
    )  # fmt: skip

    @field_validator("hosts")
    @classmethod
    def _unique_names(cls, hosts: list[SshHost]) -> list[SshHost]:
        names = [h.node_name for h in hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"hosts: node names must be unique, {duplicates} repeat; set `name` on the repeats")
        return hosts

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

    def host_inventory(self) -> list[Node]:
        """Every host, inspected (nothing is changed or acquired)."""
        return self.inspect(self.acquire(len(self.hosts), NodeRequirements(), "inventory"))

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
            slurm_labels: dict[str, str] = {}
            if self.slurm is not None:
                slurm_changes, slurm_labels = self._join_slurm(node.name, session, facts, self.slurm)
                changes += slurm_changes
            labels = {"bootstrap": "changed" if changes else "unchanged", **slurm_labels}
            if changes:
                labels["changes"] = "; ".join(changes)
            _logger().info("%s: bootstrap %s%s", node.name, labels["bootstrap"],
                           f" ({labels['changes']})" if changes else "")  # fmt: skip
            updated = self._with_facts(node, facts)
            return updated.model_copy(update={"state": STATE_READY, "labels": {**updated.labels, **labels}})

        return raise_for_failures("bootstrap", self._each(nodes, one))

    def release(self, nodes: list[Node]) -> None:
        """Take the nodes out of the Slurm cluster (drain, stop slurmd, delete), when ``slurm`` is set.

        Otherwise nothing to give back: the hosts are yours and stay as they are.
        """
        join = self.slurm
        if join is None:
            return

        def one(node: Node, session: _Session) -> Node:
            changes = self._leave_slurm(node.name, session, join)
            _logger().info("%s: release %s", node.name, "; ".join(changes) if changes else "(was not in the cluster)")
            return node.model_copy(update={"labels": {**node.labels, "slurm": "left"}})

        raise_for_failures("release", self._each(nodes, one))

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
        version = parse_ctk_version(out) if rc == 0 else None
        if version:
            facts.toolkit = version
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

    # ---- Slurm ---------------------------------------------------------------------------

    def _join_slurm(
        self, name: str, s: _Session, facts: _Facts, join: SlurmJoin
    ) -> tuple[list[str], dict[str, str]]:
        """Join node ``name`` to the cluster, checking before each change; (changes made, labels)."""
        changes = []
        if join.munge_key is not None:
            key = base64.b64decode(join.munge_key.get_secret_value())
            key_path = join.key_path(name)
            if self._remote_sha256(s, key_path, sudo=True) != _sha256(key):
                s.check(["install", "-D", "-m", "0400", "-o", join.munge_user, "-g", join.munge_user, "/dev/stdin",
                         key_path], "installing the MUNGE key",
                        f"check that user {join.munge_user} exists (is munge installed?) and the path is writable",
                        change=True, stdin=key)  # fmt: skip
                fix = "set slurm.munge_restart_command to how munged is restarted on the host"
                s.check(join.munge_restart_command, "restarting munge", fix, change=True)
                changes.append(f"installed the cluster's MUNGE key in {key_path} and restarted munge")
        changed_files = []
        for path, content in join.config_files(name, facts.gpus).items():
            data = content.encode()
            if self._remote_sha256(s, path, sudo=False) != _sha256(data):
                s.check(["install", "-D", "-m", "0644", "/dev/stdin", path], f"writing {path}",
                        "check that conf_dir is writable (root, or sudo -n)", change=True, stdin=data)  # fmt: skip
                changed_files.append(path)
        if changed_files:
            changes.append(f"installed {', '.join(changed_files)}")

        argv = join.slurmd_argv(name, facts.gpus)
        pid_file = join.pid_file(name)
        running = self._slurmd_cmdline(s, pid_file)
        if running is not None and (running != argv or changed_files):
            self._stop_slurmd(name, s, pid_file)
            self._delete_node(name, s, join)  # registers afresh, with the new definition
            changes.append(f"stopped slurmd (it ran as `{shlex.join(running)}`)")
            running = None
        if running is None:
            s.check(argv, "starting slurmd", "read the slurmd log on the host (SlurmdLogFile in slurm.conf); "
                    "the controller must be reachable from the host", change=True)  # fmt: skip
            changes.append(f"started slurmd (`{shlex.join(argv)}`)")

        info, resumed = self._wait_usable(name, s, join)
        if resumed:
            changes.append(f"resumed the node (it was {resumed})")
        labels = {"slurm": "joined", "slurm_state": info.state, "slurm_gres": info.fields.get("Gres", ""),
                  "slurm_partitions": info.fields.get("Partitions", "")}  # fmt: skip
        return changes, labels

    def _leave_slurm(self, name: str, s: _Session, join: SlurmJoin) -> list[str]:
        """Drain node ``name``, wait for its jobs to end, stop its slurmd, delete it; (changes made)."""
        changes: list[str] = []
        if s.run(["test", "-f", join.conf_path(name)])[0] != 0:
            return changes  # never joined (bootstrap stopped before the config was installed)
        pid_file = join.pid_file(name)
        try:
            info = self._node_info(name, s, join)
        except TransientError:
            # The controller does not answer: at least the node stops serving; release again to delete it.
            if self._slurmd_cmdline(s, pid_file) is not None:
                self._stop_slurmd(name, s, pid_file)
            raise
        if info is not None and not info.drained:
            if "DRAIN" not in info.flags:
                drain = join.scontrol_argv(name, "update", f"nodename={name}", "state=drain",
                                           f"reason={_RELEASE_REASON}")  # fmt: skip
                s.check(drain, f"draining {name}", "run scontrol on the host by hand and read its error", change=True)
                changes.append("drained")
            poll = Poll(0.5, 5.0, factor=2, timeout=join.drain_timeout_seconds)
            while info is not None and not info.drained:
                if poll.expired():
                    raise TransientError(
                        f"{name}: still has jobs {join.drain_timeout_seconds:.0f} s after it was drained (state "
                        f"{info.state}); release again once they ended, or cancel them (`squeue -w {name}`)"
                    )
                poll.wait()
                info = self._node_info(name, s, join)
        if self._slurmd_cmdline(s, pid_file) is not None:
            self._stop_slurmd(name, s, pid_file)
            changes.append("stopped slurmd")
        if info is not None and self._delete_node(name, s, join):
            changes.append("deleted from the cluster")
        return changes

    def _remote_sha256(self, s: _Session, path: str, *, sudo: bool) -> str | None:
        rc, out, _ = s.run(["sha256sum", "--", path], change=sudo)
        return out.split()[0] if rc == 0 and out.split() else None

    def _slurmd_cmdline(self, s: _Session, pid_file: str) -> list[str] | None:
        """The command line of the node's running slurmd, or None."""
        rc, out, err = s.run(["sh", "-c", _SLURMD_RUNNING, "sh", pid_file], change=True)
        if rc == 3:
            return None
        if rc != 0:
            raise ConfigurationError(f"{s.host.node_name}: reading {pid_file} failed (exit {rc}): {err.strip()}")
        argv = out.split("\n")
        while argv and argv[-1] == "":
            argv.pop()
        return argv or None  # an exiting slurmd has an empty command line

    def _stop_slurmd(self, name: str, s: _Session, pid_file: str) -> None:
        s.check(["sh", "-c", _SLURMD_STOP, "sh", pid_file], "stopping slurmd",
                f"stop it by hand (pid in {pid_file})", change=True)  # fmt: skip

    def _node_info(self, name: str, s: _Session, join: SlurmJoin) -> _SlurmNode | None:
        """What the controller says about node ``name``; None: it is not in the cluster."""
        rc, out, err = s.run(join.scontrol_argv(name, "show", "node", name))
        if rc != 0 and "not found" in (err + out).lower():
            return None
        if rc != 0:
            raise TransientError(f"{name}: `scontrol show node` failed (exit {rc}): {(err or out).strip()[-300:]}")
        return _SlurmNode.parse(out)

    def _delete_node(self, name: str, s: _Session, join: SlurmJoin) -> bool:
        """Delete the node from the cluster; False when it was not there."""
        rc, out, err = s.run(join.scontrol_argv(name, "delete", f"nodename={name}"), change=True)
        text = (err or out).strip()
        if rc == 0:
            return True
        if "not found" in text.lower() or "invalid node name" in text.lower():
            return False
        raise ConfigurationError(
            f"{name}: `scontrol delete nodename={name}` failed (exit {rc}): {text[-300:]}. Fix: a node with jobs "
            "cannot be deleted: wait for them (or cancel them) and release again"
        )

    def _wait_usable(self, name: str, s: _Session, join: SlurmJoin) -> tuple[_SlurmNode, str | None]:
        """Wait until the controller lists the node usable, resuming it (once) when drained or down."""
        poll = Poll(0.2, 2.0, factor=2, timeout=join.registration_timeout_seconds)
        resumed = None
        while True:
            info = self._node_info(name, s, join)
            if info is not None and info.usable:
                return info, resumed
            registered = (info is not None and info.base not in ("UNKNOWN", "FUTURE")
                          and "NOT_RESPONDING" not in info.flags)  # fmt: skip
            if registered and resumed is None and ("DRAIN" in info.flags or info.base == "DOWN"):
                resumed = info.state + (f" ({info.fields['Reason']})" if info.fields.get("Reason") else "")
                s.check(join.scontrol_argv(name, "update", f"nodename={name}", "state=resume"), f"resuming {name}",
                        "run scontrol on the host by hand and read its error", change=True)  # fmt: skip
                continue
            if poll.expired():
                seen = f"its state is {info.state}" if info else "the controller does not list it"
                raise TransientError(
                    f"{name}: not usable in Slurm {join.registration_timeout_seconds:.0f} s after slurmd started "
                    f"({seen}). Fix: read the slurmd log on the host (SlurmdLogFile), check that the host reaches "
                    "the controller (SlurmctldHost) and the controller the host (SlurmdPort)"
                )
            poll.wait()

    @staticmethod
    def _with_facts(node: Node, facts: _Facts) -> Node:
        labels = dict(node.labels)
        labels["toolkit"] = facts.toolkit or TOOLKIT_MISSING
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
        return parse_known_hosts(self.known_hosts)

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
                    delay = retry_delay(attempt, self.retry_backoff_seconds, most=float("inf"), jitter=False)
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
        try:
            return connect_verified(
                address=host.address, port=host.port, user=host.user, key=key, known=known,
                timeout=self.connect_timeout, name=f"{host.node_name} ({host.known_hosts_name})",
                check_against="is the host's own: compare with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
                "on its console",
            )  # fmt: skip
        except ConfigurationError as exc:
            if host.node_name in str(exc):
                raise
            raise ConfigurationError(f"{host.node_name}: {exc}") from exc
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise TransientError(str(exc) or type(exc).__name__) from exc

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """SSH reach, host key and login of every host (``blocks/check_slurm.py``); nothing is changed."""
        from blocks.check_slurm import check_ssh_hosts

        check_ssh_hosts(self, probe)
        return probe.rows
