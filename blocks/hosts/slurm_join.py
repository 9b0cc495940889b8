"""Your own hosts joined to a Slurm cluster as dynamic nodes (``SshHosts.slurm``), and taken out again.

``join_slurm`` brings one node into the cluster, each step checking first:

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
``PartitionName=... Nodes=x``). ``leave_slurm`` drains the node, waits (up to
``drain_timeout_seconds``) until its jobs are gone, stops its slurmd and deletes it from the
cluster (``scontrol delete nodename``); leaving twice is harmless.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from blocks.base.backoff import Poll
from blocks.errors import ConfigurationError, TransientError
from blocks.hosts.shell import HostShell
from blocks.records import GpuInfo

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
        None,
        description="The cluster's cgroup.conf (content), installed unchanged; needed where slurm.conf uses "
        "cgroup plugins (proctrack/cgroup, task/cgroup). None: not written.",
    )
    munge_key: SecretStr | None = Field(
        None,
        description="The cluster's MUNGE key, base64 (`base64 -w0 /etc/munge/munge.key`); None: the nodes "
        "already have it.",
    )
    features: list[str] = Field(
        default_factory=list, description="Features of the joined nodes (a partition's NodeSet may select them)."
    )
    conf_dir: str = Field(
        "/etc/slurm",
        description="Directory of slurm.conf and gres.conf on the nodes ({node}: the node's name, for "
        "hosts that share a filesystem).",
    )
    munge_key_path: str = Field(
        "/etc/munge/munge.key", description="Where munged reads its key on the nodes ({node}: the node's name)."
    )
    munge_user: str = Field("munge", description="Owner of the MUNGE key file.")
    munge_restart_command: list[str] = Field(
        default_factory=lambda: ["systemctl", "restart", "munge"],
        min_length=1,
        description="argv that restarts munged after its key changed.",
    )
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
        conf = " ".join(
            p
            for p in (f"Gres={gres}" if gres else "", f"Feature={','.join(self.features)}" if self.features else "")
            if p
        )
        return [self.slurmd, "-f", self.conf_path(node), "-N", node, "-Z", *(["--conf", conf] if conf else [])]

    def scontrol_argv(self, node: str, *args: str) -> list[str]:
        return ["env", f"SLURM_CONF={self.conf_path(node)}", self.scontrol, *args]


@dataclass
class SlurmNode:
    """What ``scontrol show node`` says about one node."""

    base: str  # IDLE, MIXED, ALLOCATED, DOWN, ...
    flags: set[str]  # DRAIN, NOT_RESPONDING, DYNAMIC_NORM, ...
    fields: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> SlurmNode:
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


def join_slurm(name: str, s: HostShell, gpus: Sequence[GpuInfo], join: SlurmJoin) -> tuple[list[str], dict[str, str]]:
    """Join node ``name`` to the cluster, checking before each change; (changes made, labels)."""
    changes = []
    if join.munge_key is not None:
        key = base64.b64decode(join.munge_key.get_secret_value())
        key_path = join.key_path(name)
        if _remote_sha256(s, key_path, sudo=True) != _sha256(key):
            s.check(
                ["install", "-D", "-m", "0400", "-o", join.munge_user, "-g", join.munge_user, "/dev/stdin", key_path],
                "installing the MUNGE key",
                f"check that user {join.munge_user} exists (is munge installed?) and the path is writable",
                change=True,
                stdin=key,
            )
            fix = "set slurm.munge_restart_command to how munged is restarted on the host"
            s.check(join.munge_restart_command, "restarting munge", fix, change=True)
            changes.append(f"installed the cluster's MUNGE key in {key_path} and restarted munge")
    changed_files = []
    for path, content in join.config_files(name, gpus).items():
        data = content.encode()
        if _remote_sha256(s, path, sudo=False) != _sha256(data):
            s.check(
                ["install", "-D", "-m", "0644", "/dev/stdin", path],
                f"writing {path}",
                "check that conf_dir is writable (root, or sudo -n)",
                change=True,
                stdin=data,
            )
            changed_files.append(path)
    if changed_files:
        changes.append(f"installed {', '.join(changed_files)}")

    argv = join.slurmd_argv(name, gpus)
    pid_file = join.pid_file(name)
    running = _slurmd_cmdline(s, pid_file)
    if running is not None and (running != argv or changed_files):
        _stop_slurmd(name, s, pid_file)
        _delete_node(name, s, join)  # registers afresh, with the new definition
        changes.append(f"stopped slurmd (it ran as `{shlex.join(running)}`)")
        running = None
    if running is None:
        s.check(
            argv,
            "starting slurmd",
            "read the slurmd log on the host (SlurmdLogFile in slurm.conf); "
            "the controller must be reachable from the host",
            change=True,
        )
        changes.append(f"started slurmd (`{shlex.join(argv)}`)")

    info, resumed = _wait_usable(name, s, join)
    if resumed:
        changes.append(f"resumed the node (it was {resumed})")
    labels = {
        "slurm": "joined",
        "slurm_state": info.state,
        "slurm_gres": info.fields.get("Gres", ""),
        "slurm_partitions": info.fields.get("Partitions", ""),
    }
    return changes, labels


def leave_slurm(name: str, s: HostShell, join: SlurmJoin) -> list[str]:
    """Drain node ``name``, wait for its jobs to end, stop its slurmd, delete it; (changes made)."""
    changes: list[str] = []
    if s.run(["test", "-f", join.conf_path(name)])[0] != 0:
        return changes  # never joined (bootstrap stopped before the config was installed)
    pid_file = join.pid_file(name)
    try:
        info = _node_info(name, s, join)
    except TransientError:
        # The controller does not answer: at least the node stops serving; release again to delete it.
        if _slurmd_cmdline(s, pid_file) is not None:
            _stop_slurmd(name, s, pid_file)
        raise
    if info is not None and not info.drained:
        if "DRAIN" not in info.flags:
            drain = join.scontrol_argv(name, "update", f"nodename={name}", "state=drain", f"reason={_RELEASE_REASON}")
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
            info = _node_info(name, s, join)
    if _slurmd_cmdline(s, pid_file) is not None:
        _stop_slurmd(name, s, pid_file)
        changes.append("stopped slurmd")
    if info is not None and _delete_node(name, s, join):
        changes.append("deleted from the cluster")
    return changes


def _remote_sha256(s: HostShell, path: str, *, sudo: bool) -> str | None:
    rc, out, _ = s.run(["sha256sum", "--", path], change=sudo)
    return out.split()[0] if rc == 0 and out.split() else None


def _slurmd_cmdline(s: HostShell, pid_file: str) -> list[str] | None:
    """The command line of the node's running slurmd, or None."""
    rc, out, err = s.run(["sh", "-c", _SLURMD_RUNNING, "sh", pid_file], change=True)
    if rc == 3:
        return None
    if rc != 0:
        raise ConfigurationError(f"{s.node_name}: reading {pid_file} failed (exit {rc}): {err.strip()}")
    argv = out.split("\n")
    while argv and argv[-1] == "":
        argv.pop()
    return argv or None  # an exiting slurmd has an empty command line


def _stop_slurmd(name: str, s: HostShell, pid_file: str) -> None:
    s.check(
        ["sh", "-c", _SLURMD_STOP, "sh", pid_file],
        "stopping slurmd",
        f"stop it by hand (pid in {pid_file})",
        change=True,
    )


def _node_info(name: str, s: HostShell, join: SlurmJoin) -> SlurmNode | None:
    """What the controller says about node ``name``; None: it is not in the cluster."""
    rc, out, err = s.run(join.scontrol_argv(name, "show", "node", name))
    if rc != 0 and "not found" in (err + out).lower():
        return None
    if rc != 0:
        raise TransientError(f"{name}: `scontrol show node` failed (exit {rc}): {(err or out).strip()[-300:]}")
    return SlurmNode.parse(out)


def _delete_node(name: str, s: HostShell, join: SlurmJoin) -> bool:
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


def _wait_usable(name: str, s: HostShell, join: SlurmJoin) -> tuple[SlurmNode, str | None]:
    """Wait until the controller lists the node usable, resuming it (once) when drained or down."""
    poll = Poll(0.2, 2.0, factor=2, timeout=join.registration_timeout_seconds)
    resumed = None
    while True:
        info = _node_info(name, s, join)
        if info is not None and info.usable:
            return info, resumed
        registered = info is not None and info.base not in ("UNKNOWN", "FUTURE") and "NOT_RESPONDING" not in info.flags
        if info is not None and registered and resumed is None and ("DRAIN" in info.flags or info.base == "DOWN"):
            resumed = info.state + (f" ({info.fields['Reason']})" if info.fields.get("Reason") else "")
            s.check(
                join.scontrol_argv(name, "update", f"nodename={name}", "state=resume"),
                f"resuming {name}",
                "run scontrol on the host by hand and read its error",
                change=True,
            )
            continue
        if poll.expired():
            seen = f"its state is {info.state}" if info else "the controller does not list it"
            raise TransientError(
                f"{name}: not usable in Slurm {join.registration_timeout_seconds:.0f} s after slurmd started "
                f"({seen}). Fix: read the slurmd log on the host (SlurmdLogFile), check that the host reaches "
                "the controller (SlurmctldHost) and the controller the host (SlurmdPort)"
            )
        poll.wait()
