"""What one of your own hosts has (GPUs, driver, CUDA, NVIDIA Container Toolkit, docker's runtimes), read
without changing anything; the preflight against a job's needs; configuring docker's nvidia runtime.

``read_facts`` asks the host, in one round of channels:

* ``nvidia-smi --query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader,nounits``
  and the banner of plain ``nvidia-smi`` (CUDA version);
* ``nvidia-ctk --version`` (NVIDIA Container Toolkit);
* ``docker info --format '{{json .Runtimes}}'``: is docker configured with the ``nvidia`` runtime?

``configure_runtime`` runs ``nvidia-ctk runtime configure --runtime=docker``, restarts docker and reads the
runtimes back to confirm.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from blocks.base.nvidia import (
    NVIDIA_SMI_QUERY,
    TOOLKIT_MISSING,
    parse_ctk_version,
    parse_cuda_version,
    parse_nvidia_smi,
)
from blocks.base.provider import NodeRequirements, check_node
from blocks.errors import ConfigurationError
from blocks.hosts.shell import HostShell
from blocks.records import GpuInfo, Node

EXIT_NOT_FOUND = 127  # the shell's "command not found"
DOCKER_RUNTIMES = ["docker", "info", "--format", "{{json .Runtimes}}"]
CONFIGURE_RUNTIME = ["nvidia-ctk", "runtime", "configure", "--runtime=docker"]


@dataclass
class Facts:
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


class PreflightFailed(ConfigurationError):
    """A node failed its preflight; ``node`` is the node with what was read from it."""

    def __init__(self, message: str, node: Node) -> None:
        super().__init__(message)
        self.node = node


def _problem(node: str, check: str, detail: str, fix: str) -> str:
    return f"{node}: preflight check '{check}' failed: {detail}. Fix: {fix}"


def read_facts(s: HostShell) -> Facts:
    """What the host has; nothing is changed."""
    facts = Facts()
    query, banner, ctk, runtimes, nproc, meminfo = s.run_all(
        [
            ["nvidia-smi", *NVIDIA_SMI_QUERY],
            ["nvidia-smi"],
            ["nvidia-ctk", "--version"],
            DOCKER_RUNTIMES,
            ["getconf", "_NPROCESSORS_ONLN"],
            ["cat", "/proc/meminfo"],
        ]
    )
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
    facts.runtimes, facts.docker_problem = parse_runtimes(*runtimes)
    rc, out, _ = nproc
    facts.cpus = int(out.strip()) if rc == 0 and out.strip().isdigit() else 0
    rc, out, _ = meminfo
    mem = re.search(r"^MemTotal:\s+(\d+)\s+kB", out, re.M) if rc == 0 else None
    facts.memory_mib = int(mem.group(1)) // 1024 if mem else 0
    return facts


def read_runtimes(s: HostShell) -> tuple[list[str], str | None]:
    return parse_runtimes(*s.run(DOCKER_RUNTIMES))


def parse_runtimes(rc: int, out: str, err: str) -> tuple[list[str], str | None]:
    if rc == EXIT_NOT_FOUND:
        return [], "docker not found (Docker Engine is not installed)"
    if rc != 0:
        return [], f"`docker info` failed (exit {rc}): {(err or out).strip()[-300:]}"
    try:
        runtimes = json.loads(out)
    except json.JSONDecodeError:
        return [], f"`docker info` printed no runtime list: {out.strip()[:200]!r}"
    return sorted(runtimes) if isinstance(runtimes, dict) else [], None


def preflight(
    node: str, facts: Facts, requirements: NodeRequirements, *, require_gpus: bool, fixable_runtime: bool
) -> list[str]:
    """Every way the host falls short of ``requirements`` (and of ``require_gpus``), each naming the fix."""
    problems = []
    needs_gpus = require_gpus or requirements.gpus > 0
    if facts.gpu_problem and needs_gpus:
        fix = "install the NVIDIA driver on the host, or remove the host from the block"
        problems.append(_problem(node, "nvidia-smi", facts.gpu_problem, fix))
    problems += [
        p.replace(f"{node}: ", f"{node}: preflight check 'gpus' failed: ", 1)
        for p in check_node(Node(name=node, provider="", gpus=facts.gpus), requirements)
    ]
    if facts.gpus:
        if facts.toolkit_problem:
            fix = "install nvidia-container-toolkit (NVIDIA's apt/yum repository) on the host"
            problems.append(_problem(node, "nvidia-ctk", facts.toolkit_problem, fix))
        if facts.docker_problem:
            problems.append(
                _problem(
                    node, "docker", facts.docker_problem, "install Docker Engine and start it (systemctl start docker)"
                )
            )
        elif not facts.nvidia_runtime and not fixable_runtime:
            found = f"docker has no nvidia runtime (runtimes: {', '.join(facts.runtimes) or 'none'})"
            fix = "run bootstrap, or `nvidia-ctk runtime configure --runtime=docker` and restart docker"
            problems.append(_problem(node, "docker-nvidia-runtime", found, fix))
    return problems


def configure_runtime(node: str, s: HostShell, restart_command: Sequence[str]) -> None:
    """Give docker the nvidia runtime (``nvidia-ctk``), restart it, and confirm."""
    s.check(
        CONFIGURE_RUNTIME,
        "configuring docker's nvidia runtime",
        "run it by hand on the host and read its output (it needs root, or sudo -n)",
        change=True,
    )
    s.check(
        restart_command,
        "restarting docker",
        "set docker_restart_command to how docker is restarted on the host",
        change=True,
    )
    runtimes, problem = read_runtimes(s)
    if "nvidia" not in runtimes:
        raise ConfigurationError(
            f"{node}: docker still has no nvidia runtime after `{shlex.join(CONFIGURE_RUNTIME)}` and a restart "
            f"({problem or 'runtimes: ' + (', '.join(runtimes) or 'none')}). Fix: check /etc/docker/daemon.json "
            "on the host and that docker_restart_command really restarts docker"
        )


def with_facts(node: Node, facts: Facts) -> Node:
    """``node`` with its GPUs, CPUs, memory, toolkit and container runtime as read."""
    labels = dict(node.labels)
    labels["toolkit"] = facts.toolkit or TOOLKIT_MISSING
    labels["container_runtime"] = (
        "docker (nvidia)" if facts.nvidia_runtime else "docker" if not facts.docker_problem else "missing"
    )
    return node.model_copy(
        update={"gpus": facts.gpus, "cpus": facts.cpus, "memory_mib": facts.memory_mib, "labels": labels}
    )
