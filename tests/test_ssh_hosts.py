"""Bring-your-own GPU hosts over SSH, against real sshd servers in network namespaces.

The session fixture makes one network namespace per test host (a veth pair to this namespace, a /30
each inside $GPUFERRY_TESTHOSTS_NET.0/24, default 10.231.7.0/24), runs a real sshd in each with its
own host key, and gives its logins a PATH directory of fake `nvidia-smi`, `nvidia-ctk`, `docker` and
`systemctl` commands that print what a two-A100 node or an RTX 3090 node prints. The fake docker
keeps its runtime configuration in files: `nvidia-ctk runtime configure` writes daemon.json and
only a `systemctl restart docker` makes `docker info` list the nvidia runtime, so the bootstrap's
change, and that a second run makes none, can be observed. A third host has no GPU and no toolkit;
a fourth namespace has an address but no sshd (unreachable). Everything is removed at the end.

Each namespace also has a route to the local Slurm stack's controller address (scripts/slurm.sh,
SLURM_CTLD_ADDR), so the GPU hosts can join that real cluster as dynamic nodes: the hosts share
this machine's filesystem (and its munged, whose socket is a file) but have their own network, so
their slurmd listens on the host's own address and the controller reaches it there. Their GPUs are
character devices made with mknod under a directory of each node (gres.conf File=).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from blocks.base.nvidia import parse_nvidia_smi
from blocks.base.provider import (
    STATE_FAILED,
    STATE_READY,
    STATE_UNREACHABLE,
    NodeRequirements,
    NodesFailed,
    NodesUnreachable,
)
from blocks.errors import ConfigurationError
from blocks.hosts.provider import SshHost, SshHosts
from blocks.hosts.slurm_join import SlurmJoin, gres_type
from blocks.records import Node
from blocks.ssh.credentials import SshCredentials
from tasks.provision import inventory_rows
from tasks.retry import is_transient
from tests.stacks import stack_env, stacks_root

pytestmark = pytest.mark.integration

NET = os.environ.get("GPUFERRY_TESTHOSTS_NET", "10.231.7")  # the first three octets of a private /24
PREFIX = "gfssh"
LOCK = Path("/run/lock/gpuferry-testhosts.lock")

A100 = {
    "query": "0, NVIDIA A100-SXM4-80GB, 81920, 550.54.15, GPU-5e0e6a7c-0d4a-4c41-a1a2-0f6f5f3c0001\n"
    "1, NVIDIA A100-SXM4-80GB, 81920, 550.54.15, GPU-5e0e6a7c-0d4a-4c41-a1a2-0f6f5f3c0002\n",
    "driver": "550.54.15",
    "cuda": "12.4",
    "rows": [
        ("0", "NVIDIA A100-SXM4-80GB", "00000000:07:00.0", "61W /  400W", "81920MiB"),
        ("1", "NVIDIA A100-SXM4-80GB", "00000000:0F:00.0", "63W /  400W", "81920MiB"),
    ],
}
RTX3090 = {
    "query": "0, NVIDIA GeForce RTX 3090, 24576, 535.171.04, GPU-2b1f9d33-7c6e-4d0a-9e8b-3a4c5d6e0003\n",
    "driver": "535.171.04",
    "cuda": "12.2",
    "rows": [("0", "NVIDIA GeForce RTX 3090", "00000000:01:00.0", "22W /  350W", "24576MiB")],
}


def banner(gpu: dict) -> str:
    """Plain `nvidia-smi` output of a node with these GPUs."""
    lines = [
        "Tue Mar 12 10:15:42 2024       ",
        "+-----------------------------------------------------------------------------------------+",
        f"| NVIDIA-SMI {gpu['driver']:<22} Driver Version: {gpu['driver']:<14} CUDA Version: {gpu['cuda']:<9}|",
        "|-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|=========================================+========================+======================|",
    ]
    for index, name, bus, power, memory in gpu["rows"]:
        lines += [
            f"| {index:>3}  {name:<26}     On  | {bus:>18} Off |                    0 |",
            f"| N/A   33C    P0          {power:>14} | {'0MiB / ' + memory:>22} |      0%      Default |",
            "+-----------------------------------------+------------------------+----------------------+",
        ]
    lines += [
        "",
        "| Processes:                                                                              |",
        "|  No running processes found                                                             |",
    ]
    return "\n".join(lines) + "\n"


LOG_CALL = 'printf "%s\\n" "$(basename "$0") $*" >>"$STATE/calls.log"\n'
NVIDIA_SMI = """#!/bin/bash
STATE={state}
{log}case "$*" in
  "--query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader,nounits") cat {data}/query.csv ;;
  "") cat {data}/banner.txt ;;
  *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2; exit 2 ;;
esac
"""
NVIDIA_CTK = """#!/bin/bash
STATE={state}
{log}case "$*" in
  "--version") printf 'NVIDIA Container Toolkit CLI version 1.15.0\\ncommit: ddeeca392c7bd8b33d0a66400b77af7a97e16cef\\n' ;;
  "runtime configure --runtime=docker")
    printf '{{\\n    "runtimes": {{\\n        "nvidia": {{\\n            "args": [],\\n            "path": "nvidia-container-runtime"\\n        }}\\n    }}\\n}}\\n' >"$STATE/daemon.json"
    echo 'INFO[0000] Config file does not exist; using empty config' >&2
    echo 'INFO[0000] Wrote updated config to /etc/docker/daemon.json' >&2
    echo 'INFO[0000] It is recommended that docker daemon be restarted.' >&2 ;;
  *) echo "nvidia-ctk: unsupported arguments: $*" >&2; exit 1 ;;
esac
"""  # noqa: E501 - a stand-in program's output, byte for byte as the real one prints it
DOCKER = """#!/bin/bash
STATE={state}
{log}case "$*" in
  "info --format {{{{json .Runtimes}}}}")
    if [ -f "$STATE/running-nvidia" ]; then
      echo '{{"io.containerd.runc.v2":{{"path":"runc"}},"nvidia":{{"path":"nvidia-container-runtime"}},"runc":{{"path":"runc"}}}}'
    else
      echo '{{"io.containerd.runc.v2":{{"path":"runc"}},"runc":{{"path":"runc"}}}}'
    fi ;;
  *) echo "docker: unsupported arguments: $*" >&2; exit 1 ;;
esac
"""  # noqa: E501 - a stand-in program's output, byte for byte as the real one prints it
# The restart waits (bounded) until every host of a parallel run has started its restart: with a
# barrier set up, a serial bootstrap fails here instead of passing by luck.
SYSTEMCTL = """#!/bin/bash
STATE={state}
BARRIER={barrier}
{log}case "$*" in
  "restart munge") ;;
  "restart docker")
    if [ -f "$BARRIER/expected" ]; then
      touch "$BARRIER/started-{name}"
      expected=$(cat "$BARRIER/expected"); deadline=$((SECONDS + 60))
      until [ "$(ls "$BARRIER" | grep -c '^started-')" -ge "$expected" ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then echo "barrier: the other restarts did not start within 60 s" >&2; exit 1; fi
        sleep 0.05
      done
    fi
    if grep -q '"nvidia"' "$STATE/daemon.json" 2>/dev/null; then touch "$STATE/running-nvidia"; else rm -f "$STATE/running-nvidia"; fi ;;
  *) echo "systemctl: unsupported arguments: $*" >&2; exit 1 ;;
esac
"""  # noqa: E501 - a stand-in program's output, byte for byte as the real one prints it


def ctld_addr() -> str | None:
    """The local Slurm stack's controller address for joining nodes, when the stack is up."""
    env = stacks_root() / "slurm" / "env"
    if not env.exists():
        return None
    for line in env.read_text().splitlines():
        if line.startswith("SLURM_CTLD_ADDR="):
            return line.partition("=")[2].strip() or None
    return None


def run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


@dataclass
class FakeHost:
    name: str
    index: int
    kind: str  # a100, rtx3090, cpu, down
    root: Path
    barrier: Path

    @property
    def ns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def address(self) -> str:
        return f"{NET}.{4 * self.index + 2}"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def pidfile(self) -> Path:
        return self.root / "sshd.pid"

    @property
    def host_key_pub(self) -> str:
        return (self.root / "host_key.pub").read_text().split(" ", 2)[:2]  # type: ignore[return-value]

    def known_hosts_line(self) -> str:
        key_type, key = self.host_key_pub
        return f"{self.address} {key_type} {key}"

    def calls(self) -> list[str]:
        path = self.state / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def reset(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)
        self.state.mkdir(parents=True)

    def write_fakes(self) -> None:
        bin_dir, data = self.root / "bin", self.root / "data"
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        data.mkdir(exist_ok=True)
        fmt = {"state": self.state, "data": data, "barrier": self.barrier, "name": self.name, "log": LOG_CALL}
        scripts = {"docker": DOCKER, "systemctl": SYSTEMCTL}
        if self.kind in ("a100", "rtx3090"):
            gpu = A100 if self.kind == "a100" else RTX3090
            (data / "query.csv").write_text(gpu["query"])
            (data / "banner.txt").write_text(banner(gpu))
            scripts.update({"nvidia-smi": NVIDIA_SMI, "nvidia-ctk": NVIDIA_CTK})
        for command, template in scripts.items():
            path = bin_dir / command
            path.write_text(template.format(**fmt))
            path.chmod(0o755)

    def create_namespace(self) -> None:
        root_if, ns_if = f"{PREFIX}R{self.index}", f"{PREFIX}N{self.index}"
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "add", root_if, "type", "veth", "peer", "name", ns_if)
        run("ip", "link", "set", ns_if, "netns", self.ns)
        run("ip", "addr", "add", f"{NET}.{4 * self.index + 1}/30", "dev", root_if)
        run("ip", "link", "set", root_if, "up")
        run("ip", "-n", self.ns, "addr", "add", f"{self.address}/30", "dev", ns_if)
        run("ip", "-n", self.ns, "link", "set", ns_if, "up")
        run("ip", "-n", self.ns, "link", "set", "lo", "up")
        controller = ctld_addr()
        if controller:  # the Slurm controller, reached through this machine's end of the pair
            run("ip", "-n", self.ns, "route", "add", f"{controller}/32", "via", f"{NET}.{4 * self.index + 1}")

    def start_sshd(self, authorized_keys: Path) -> None:
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key"))
        config = self.root / "sshd_config"
        path = f"{self.root / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        config.write_text(
            f"ListenAddress {self.address}\nPort 22\nHostKey {self.root / 'host_key'}\nPidFile {self.pidfile}\n"
            f"AuthorizedKeysFile {authorized_keys}\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"SetEnv PATH={path} HOME={self.root / 'home'}\n"  # each host its own home (and shell startup files)
        )
        log = self.root / "sshd.log"
        run("nsenter", f"--net=/run/netns/{self.ns}", "/usr/sbin/sshd", "-f", str(config), "-E", str(log))
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((self.address, 22), timeout=2) as sock:
                    if sock.recv(64).startswith(b"SSH-2.0"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"sshd of {self.name} did not answer on {self.address}:22 within 30 s: {tail}")
            time.sleep(0.1)

    def stop_sshd(self) -> None:
        if not self.pidfile.exists():
            return
        pid = int(self.pidfile.read_text().strip())
        _kill(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _remove_namespace(ns: str, root_if: str) -> None:
    """Stop what runs in ``ns`` (our sshd) and delete it; its veth pair goes with it."""
    if ns in run("ip", "netns", "list").split():
        for pid in run("ip", "netns", "pids", ns).split():
            _kill(int(pid))
        run("ip", "netns", "delete", ns)
    # The root end goes with the namespace (asynchronously); one left over from a half-made pair is removed.
    proc = subprocess.run(["ip", "link", "delete", root_if], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "Cannot find device" not in proc.stderr:
        raise RuntimeError(f"ip link delete {root_if} failed: {proc.stderr.strip()}")


class FakeHosts:
    def __init__(self, hosts: dict[str, FakeHost], client_key: str) -> None:
        self.hosts, self.client_key = hosts, client_key

    def __getitem__(self, name: str) -> FakeHost:
        return self.hosts[name]

    def known_hosts(self) -> str:
        return "".join(h.known_hosts_line() + "\n" for h in self.hosts.values() if h.kind != "down")

    def block(self, *names: str, known_hosts: str | None = None, **settings: object) -> SshHosts:
        return SshHosts(
            hosts=[SshHost(address=self[n].address, name=n) for n in names],
            credentials=SshCredentials(
                private_key=self.client_key, known_hosts=self.known_hosts() if known_hosts is None else known_hosts
            ),
            connect_timeout=5,
            **settings,
        )


@pytest.fixture(scope="session")
def testhosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHosts]:
    if os.geteuid() != 0:
        pytest.fail("the SSH test hosts need root (network namespaces, sshd)")
    if not Path("/usr/sbin/sshd").exists():
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "openssh-server"],
            check=True,
            capture_output=True,
            timeout=1200,
        )
    for tool in ("ip", "nsenter", "ssh-keygen"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install iproute2 util-linux openssh-client")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = LOCK.open("w")
    deadline = time.monotonic() + 600  # another session's test hosts use the same names and addresses
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"{LOCK} stayed locked for 600 s (another test session's SSH test hosts)")
            time.sleep(0.5)

    root = tmp_path_factory.mktemp("testhosts")
    barrier = root / "barrier"
    barrier.mkdir()
    kinds = {"a100": "a100", "rtx3090": "rtx3090", "cpu": "cpu", "down": "down"}
    hosts = {name: FakeHost(name, i, kind, root / name, barrier) for i, (name, kind) in enumerate(kinds.items())}
    for host in hosts.values():  # left over by a killed session (we hold the lock: nobody else uses them)
        _remove_namespace(host.ns, f"{PREFIX}R{host.index}")
    try:
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key"))
        shutil.copy(root / "client_key.pub", root / "authorized_keys")
        for host in hosts.values():
            host.root.mkdir()
            host.reset()
            host.write_fakes()
            host.create_namespace()
            if host.kind != "down":
                host.start_sshd(root / "authorized_keys")
        yield FakeHosts(hosts, (root / "client_key").read_text())
    finally:
        for host in hosts.values():
            host.stop_sshd()
            _remove_namespace(host.ns, f"{PREFIX}R{host.index}")
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


@pytest.fixture
def hosts(testhosts: FakeHosts) -> FakeHosts:
    """The test hosts with fresh state: docker without the nvidia runtime, no calls recorded."""
    for host in testhosts.hosts.values():
        host.reset()
    for entry in testhosts["a100"].barrier.iterdir():
        entry.unlink()
    return testhosts


CHANGING = ("nvidia-ctk runtime configure --runtime=docker", "systemctl restart docker")


def test_bootstrap_two_hosts_in_parallel_then_a_second_run_changes_nothing(hosts: FakeHosts) -> None:
    block = hosts.block("a100", "rtx3090")
    (hosts["a100"].barrier / "expected").write_text("2")  # each restart waits for the other one's
    nodes = block.acquire(2, NodeRequirements(gpus=1), "run-1")
    assert [n.name for n in nodes] == ["a100", "rtx3090"]

    first = block.bootstrap(nodes, NodeRequirements(gpus=1, min_gpu_memory_mib=20000))
    assert [(n.name, n.state, n.labels["bootstrap"]) for n in first] == [
        ("a100", STATE_READY, "changed"),
        ("rtx3090", STATE_READY, "changed"),
    ]
    a100, rtx = first
    assert [(g.index, g.name, g.memory_mib, g.driver_version, g.cuda_version) for g in a100.gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", 81920, "550.54.15", "12.4"),
        (1, "NVIDIA A100-SXM4-80GB", 81920, "550.54.15", "12.4"),
    ]
    assert [(g.name, g.memory_mib, g.driver_version, g.cuda_version) for g in rtx.gpus] == [
        ("NVIDIA GeForce RTX 3090", 24576, "535.171.04", "12.2")
    ]
    assert a100.labels["toolkit"] == "1.15.0" and a100.labels["container_runtime"] == "docker (nvidia)"
    assert a100.cpus > 0 and a100.memory_mib > 0
    assert [g.uuid for g in a100.gpus] == [
        "GPU-5e0e6a7c-0d4a-4c41-a1a2-0f6f5f3c0001",
        "GPU-5e0e6a7c-0d4a-4c41-a1a2-0f6f5f3c0002",
    ]  # what a Docker host's GPUs go by
    for name in ("a100", "rtx3090"):
        assert [c for c in hosts[name].calls() if c in CHANGING] == list(CHANGING)
        assert (hosts[name].state / "running-nvidia").exists()
    assert sorted(p.name for p in hosts["a100"].barrier.glob("started-*")) == ["started-a100", "started-rtx3090"]

    before = {name: len(hosts[name].calls()) for name in ("a100", "rtx3090")}
    second = block.bootstrap(nodes, NodeRequirements(gpus=1))
    assert [(n.state, n.labels["bootstrap"]) for n in second] == [(STATE_READY, "unchanged")] * 2
    for name in ("a100", "rtx3090"):
        calls = hosts[name].calls()[before[name] :]
        assert calls and not [c for c in calls if c in CHANGING], calls  # it looked, and changed nothing

    rows = inventory_rows(second)
    assert rows[0]["toolkit"] == "1.15.0" and rows[0]["driver"] == "550.54.15" and rows[0]["cuda"] == "12.4"
    assert rows[0]["state"] == "ready"
    # The read-only preflight passes now.
    assert [n.state for n in block.check(nodes, NodeRequirements(gpus=1))] == [STATE_READY] * 2
    # Every host's inventory, read without acquiring or changing anything (what a Docker backend chooses GPUs from).
    before = {name: len(hosts[name].calls()) for name in ("a100", "rtx3090")}
    inventory = block.host_inventory()
    assert [(n.name, len(n.gpus)) for n in inventory] == [("a100", 2), ("rtx3090", 1)]
    assert inventory[1].gpus[0].uuid == "GPU-2b1f9d33-7c6e-4d0a-9e8b-3a4c5d6e0003"
    assert not [c for name in ("a100", "rtx3090") for c in hosts[name].calls()[before[name] :] if c in CHANGING]


def test_host_without_gpus_fails_preflight_naming_host_and_check(hosts: FakeHosts) -> None:
    block = hosts.block("a100", "cpu")
    nodes = block.acquire(2, NodeRequirements(gpus=1), "run-2")
    with pytest.raises(NodesFailed) as info:
        block.bootstrap(nodes, NodeRequirements(gpus=1))
    message = str(info.value)
    assert "bootstrap failed on 1 of 2 node(s) (finished on: a100)" in message
    assert "cpu: preflight check 'nvidia-smi' failed: nvidia-smi not found (no NVIDIA driver installed)" in message
    assert "0 GPU(s) found, 1 required" in message
    assert not is_transient(info.value)
    by_name = {n.name: n for n in info.value.nodes}
    assert by_name["a100"].state == STATE_READY and by_name["a100"].labels["bootstrap"] == "changed"
    assert by_name["cpu"].state == STATE_FAILED and "nvidia-smi" in by_name["cpu"].labels["error"]
    assert not [c for c in hosts["cpu"].calls() if c in CHANGING]  # nothing was changed on the failed host
    assert inventory_rows(info.value.nodes)[1]["state"].startswith("failed: cpu: preflight check 'nvidia-smi'")

    # A GPU host without the toolkit fails on the toolkit check, named.
    (hosts["rtx3090"].root / "bin" / "nvidia-ctk").rename(hosts["rtx3090"].root / "nvidia-ctk.off")
    try:
        with pytest.raises(NodesFailed, match=r"rtx3090: preflight check 'nvidia-ctk' failed: nvidia-ctk not found"):
            single = hosts.block("rtx3090")
            single.bootstrap(single.acquire(1, NodeRequirements(), "r"), NodeRequirements())
    finally:
        (hosts["rtx3090"].root / "nvidia-ctk.off").rename(hosts["rtx3090"].root / "bin" / "nvidia-ctk")


def test_unreachable_host_is_retried_then_fails_while_the_other_host_goes_on(
    hosts: FakeHosts, caplog: pytest.LogCaptureFixture
) -> None:
    block = hosts.block("rtx3090", "down", connect_attempts=3, retry_backoff_seconds=0.2)
    nodes = block.acquire(2, NodeRequirements(), "run-3")
    with caplog.at_level(logging.WARNING, logger="gpuferry.ssh_hosts"), pytest.raises(NodesUnreachable) as info:
        block.bootstrap(nodes, NodeRequirements(gpus=1))
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert [m.split(" failed")[0] for m in retries] == ["down: connection attempt 1/3", "down: connection attempt 2/3"]
    assert "retrying in 0.2 s" in retries[0] and "retrying in 0.4 s" in retries[1]  # exponential backoff
    message = str(info.value)
    assert "bootstrap failed on 1 of 2 node(s) (finished on: rtx3090)" in message
    assert f"down is unreachable: 3 connection attempt(s) to root@{hosts['down'].address}:22" in message
    assert is_transient(info.value)  # the provision task may try again later
    by_name = {n.name: n for n in info.value.nodes}
    assert by_name["down"].state == STATE_UNREACHABLE
    assert by_name["rtx3090"].state == STATE_READY and by_name["rtx3090"].labels["bootstrap"] == "changed"
    assert (hosts["rtx3090"].state / "running-nvidia").exists()


def test_changed_or_unknown_host_key_is_refused(hosts: FakeHosts, caplog: pytest.LogCaptureFixture) -> None:
    impostor = hosts["a100"].root.parent / "impostor_key"
    if not impostor.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(impostor))
    key_type, key = (impostor.with_suffix(".pub")).read_text().split()[:2]
    pinned = f"{hosts['a100'].address} {key_type} {key}\n"  # known_hosts pins another key for the a100 host
    with caplog.at_level(logging.WARNING, logger="gpuferry.ssh_hosts"), pytest.raises(NodesFailed) as info:
        hosts.block("a100", known_hosts=pinned).inspect(hosts.block("a100").acquire(1, NodeRequirements(), "r"))
    message = str(info.value)
    offered = run("ssh-keygen", "-lf", str(hosts["a100"].root / "host_key.pub")).split()[1]
    expected = run("ssh-keygen", "-lf", str(impostor.with_suffix(".pub"))).split()[1]
    assert "the SSH host key of a100" in message and "CHANGED" in message
    assert expected in message and offered in message and "replace its line in known_hosts" in message
    assert not is_transient(info.value)
    assert not [r for r in caplog.records if "connection attempt" in r.getMessage()]  # refused, not retried
    assert hosts["a100"].calls() == []  # no command ran on it

    with pytest.raises(NodesFailed, match=r"is not in known_hosts .*refusing to connect") as info:
        hosts.block("a100", known_hosts="").inspect(hosts.block("a100").acquire(1, NodeRequirements(), "r"))
    assert offered in str(info.value)


def test_acquire_more_nodes_than_hosts_is_refused_before_anything_runs(hosts: FakeHosts) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"resources.nodes=3 but this SshHosts block has 2 host\(s\) "
        r"\(a100, rtx3090\): add hosts",
    ):
        hosts.block("a100", "rtx3090").acquire(3, NodeRequirements(), "run-4")
    with pytest.raises(ValueError, match="node names must be unique"):
        SshHosts(hosts=[SshHost(address="10.0.0.1"), SshHost(address="10.0.0.1")], private_key="k", known_hosts="")


@pytest.mark.usefixtures("prefect_server")
def test_provision_task_bootstraps_and_writes_the_inventory(hosts: FakeHosts) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
    from prefect.runtime import flow_run

    from tasks.provision import provision_nodes

    @flow
    def provision(names: list[str]) -> tuple[str, list[str]]:
        try:
            nodes = provision_nodes(hosts.block(*names), len(names), NodeRequirements(gpus=1), "run-5")
            return str(flow_run.get_id()), [n.state for n in nodes]
        except NodesFailed:
            return str(flow_run.get_id()), ["failed"]

    def inventory(run_id: str) -> list[dict[str, str]]:
        async def read() -> list:
            async with get_client() as client:
                return await client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["node-inventory"])),
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])),
                )

        (artifact,) = asyncio.run(read())
        return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data

    run_id, states = provision(["a100", "rtx3090"])
    assert states == [STATE_READY, STATE_READY]
    rows = inventory(run_id)
    assert [(r["host"], r["toolkit"], r["driver"], r["cuda"], r["state"]) for r in rows] == [
        ("a100", "1.15.0", "550.54.15", "12.4", "ready"),
        ("rtx3090", "1.15.0", "535.171.04", "12.2", "ready"),
    ]

    run_id, states = provision(["a100", "cpu"])  # the failed host is in the inventory, with why
    assert states == ["failed"]
    rows = {r["host"]: r for r in inventory(run_id)}
    assert rows["a100"]["state"] == "ready" and rows["cpu"]["toolkit"] == "missing"
    assert rows["cpu"]["state"].startswith("failed: cpu: preflight check 'nvidia-smi' failed")


# ---- joining the real local Slurm cluster ------------------------------------------------------------


def slurm_cmd(env: dict[str, str], *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, "SLURM_CONF": env["SLURM_CONF"]}
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def slurmd_pid(join: SlurmJoin, node: str) -> int | None:
    path = Path(join.pid_file(node))
    if not path.exists():
        return None
    pid = int(path.read_text().strip())
    try:
        alive = Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd" and _alive(pid)
    except OSError:
        return None
    return pid if alive else None


def in_cluster(env: dict[str, str], node: str) -> bool:
    proc = slurm_cmd(env, "scontrol", "show", "node", node, check=False)
    if proc.returncode != 0 and "not found" in (proc.stdout + proc.stderr):
        return False
    assert proc.returncode == 0, proc.stderr
    return True


@pytest.fixture
def joining(hosts: FakeHosts, tmp_path: Path) -> Iterator[tuple[SshHosts, dict[str, str], dict[str, str]]]:
    """An SshHosts block of the A100 and RTX 3090 hosts that joins the local Slurm stack, node names unique per run.

    Yields (block, {host: node name}, the stack's settings); at the end every node it may have left
    behind is taken out of the cluster and its slurmd stopped.
    """
    env = stack_env("slurm")
    if "SLURM_JOIN_PARTITION" not in env or not ctld_addr():
        pytest.fail("the slurm stack does not take joining nodes: run `make slurm-up` (scripts/slurm.sh) again")
    run_id = uuid.uuid4().hex[:6]
    names = {"a100": f"gfj{run_id}-a100", "rtx3090": f"gfj{run_id}-rtx"}
    minor = 200 + int(run_id, 16) % 40 * 4  # fake GPU device numbers: major 195 (nvidia), minors of this run
    for host, node in names.items():
        dev = tmp_path / node / "dev"
        dev.mkdir(parents=True)
        for index in range(2 if host == "a100" else 1):
            os.mknod(dev / f"nvidia{index}", 0o666 | 0o020000, os.makedev(195, minor + index))
        minor += 2
    join = SlurmJoin(
        slurm_conf=Path(env["SLURM_CONF"]).read_text(),
        gres_conf=Path(env["SLURM_GRES_CONF"]).read_text(),
        cgroup_conf=(Path(env["SLURM_CONF"]).parent / "cgroup.conf").read_text(),
        munge_key=base64.b64encode(Path(env["SLURM_MUNGE_KEY"]).read_bytes()).decode(),
        features=[env["SLURM_JOIN_FEATURE"]],
        conf_dir=f"{tmp_path}/{{node}}/etc-slurm",  # the hosts share this filesystem: one directory each
        munge_key_path=f"{tmp_path}/{{node}}/munge/munge.key",
        gpu_device=f"{tmp_path}/{{node}}/dev/nvidia{{index}}",
        registration_timeout_seconds=180,
        drain_timeout_seconds=180,
    )
    block = SshHosts(
        hosts=[SshHost(address=hosts[h].address, name=node) for h, node in names.items()],
        credentials=SshCredentials(private_key=hosts.client_key, known_hosts=hosts.known_hosts()),
        connect_timeout=5,
        slurm=join,
    )
    try:
        yield block, names, env
    finally:
        leftovers = [n for n in names.values() if in_cluster(env, n) or slurmd_pid(join, n)]
        if leftovers:
            block.release([Node(name=n, provider="test") for n in leftovers])
        spool = next(
            (line.split("=", 1)[1] for line in join.slurm_conf.splitlines() if line.startswith("SlurmdSpoolDir=")), None
        )
        for node in names.values():
            if spool:
                shutil.rmtree(spool.replace("%n", node), ignore_errors=True)
            for cgroup in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
                for directory in sorted(cgroup.rglob("*"), key=lambda d: -len(d.parts)) + [cgroup]:
                    if directory.is_dir():
                        with contextlib.suppress(OSError):
                            directory.rmdir()


def wait_job(env: dict[str, str], job_id: str) -> str:
    """The job's final state, polled from the controller (generous deadline: the machine is shared)."""
    deadline = time.monotonic() + 300
    while True:
        out = slurm_cmd(env, "scontrol", "show", "job", job_id).stdout
        state = out.split("JobState=", 1)[1].split()[0]
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
            return state
        assert time.monotonic() < deadline, f"job {job_id} still {state} after 300 s:\n{out}"
        time.sleep(0.5)


def test_hosts_join_the_slurm_cluster_run_a_job_and_leave_at_release(
    hosts: FakeHosts, joining: tuple[SshHosts, dict[str, str], dict[str, str]], tmp_path: Path
) -> None:
    block, names, env = joining
    a100, rtx = names["a100"], names["rtx3090"]
    partition = env["SLURM_JOIN_PARTITION"]
    nodes = block.acquire(2, NodeRequirements(gpus=1), "run-join")

    first = block.bootstrap(nodes, NodeRequirements(gpus=1))
    assert [(n.name, n.state, n.labels["bootstrap"], n.labels["slurm"]) for n in first] == [
        (a100, STATE_READY, "changed", "joined"),
        (rtx, STATE_READY, "changed", "joined"),
    ]
    for node, host in ((first[0], "a100"), (first[1], "rtx3090")):
        changes = node.labels["changes"]
        assert "installed the cluster's MUNGE key" in changes and "slurm.conf" in changes
        assert "started slurmd" in changes
        assert "systemctl restart munge" in hosts[host].calls()
        key = Path(block.slurm.key_path(node.name))
        assert key.read_bytes() == Path(env["SLURM_MUNGE_KEY"]).read_bytes() and key.stat().st_mode & 0o777 == 0o400
        assert Path(block.slurm.conf_path(node.name)).read_text() == Path(env["SLURM_CONF"]).read_text()

    # Both are in the real cluster, in the joined partition, with the GPUs their nvidia-smi lists.
    sinfo = slurm_cmd(env, "sinfo", "-h", "-N", "-n", f"{a100},{rtx}", "-o", "%N|%T|%G|%P").stdout
    rows = {line.split("|")[0]: line.split("|")[1:] for line in sinfo.splitlines()}
    assert rows[a100][0] == "idle" and rows[a100][1].startswith("gpu:a100-sxm4-80gb:2") and rows[a100][2] == partition
    assert rows[rtx][0] == "idle" and rows[rtx][1].startswith("gpu:geforce_rtx_3090:1") and rows[rtx][2] == partition
    shown = slurm_cmd(env, "scontrol", "show", "node", a100).stdout
    assert f"NodeAddr={hosts['a100'].address} " in shown  # the controller talks to the host's own address
    assert f"ActiveFeatures={env['SLURM_JOIN_FEATURE']}" in shown

    # A job pinned to the A100 node gets its two GPUs and runs in that host's network.
    out = tmp_path / "job-%j.out"
    job_id = slurm_cmd(
        env,
        "sbatch",
        "--parsable",
        "-p",
        partition,
        "-w",
        a100,
        "--gres=gpu:2",
        "-t",
        "5",
        "-o",
        str(out),
        "--wrap",
        'echo "node=$SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES addr=$(hostname -I)"',
    ).stdout.strip()
    assert wait_job(env, job_id) == "COMPLETED"
    printed = Path(str(out).replace("%j", job_id.split(";")[0])).read_text()
    assert f"node={a100} gpus=0,1 addr={hosts['a100'].address}" in printed, printed

    # Bootstrapping again changes nothing: same slurmd, no file written, no restart.
    pids = {n: slurmd_pid(block.slurm, n) for n in names.values()}
    before = {h: len(hosts[h].calls()) for h in names}
    second = block.bootstrap(nodes, NodeRequirements(gpus=1))
    assert [(n.state, n.labels["bootstrap"]) for n in second] == [(STATE_READY, "unchanged")] * 2, [
        n.labels.get("changes") for n in second
    ]
    assert {n: slurmd_pid(block.slurm, n) for n in names.values()} == pids and all(pids.values())
    for host in names:
        assert not [c for c in hosts[host].calls()[before[host] :] if c.startswith("systemctl")]

    # A node drained behind our back is resumed by the next bootstrap (and only that one changes).
    slurm_cmd(env, "scontrol", "update", f"nodename={rtx}", "state=drain", "reason=test")
    third = block.bootstrap(nodes, NodeRequirements(gpus=1))
    assert [n.labels["bootstrap"] for n in third] == ["unchanged", "changed"]
    assert third[1].labels["changes"].startswith("resumed the node (it was IDLE+DRAIN")
    assert slurm_cmd(env, "sinfo", "-h", "-N", "-n", rtx, "-o", "%T").stdout.strip() == "idle"

    # Release: drained, slurmd stopped, the nodes gone from the cluster; twice is harmless.
    block.release(nodes)
    for node in names.values():
        assert not in_cluster(env, node) and slurmd_pid(block.slurm, node) is None
        assert pids[node] is not None and not _alive(pids[node])
    assert slurm_cmd(env, "sinfo", "-h", "-N", "-n", f"{a100},{rtx}", "-o", "%N").stdout.strip() == ""
    block.release(nodes)


def test_slurm_join_settings_are_checked_before_anything_runs() -> None:
    conf = "ClusterName=c\nSlurmctldHost=ctl(10.0.0.1)\nMaxNodeCount=10\n"
    with pytest.raises(ValueError, match=r"no MaxNodeCount: the cluster does not take dynamic nodes; add MaxNodeCount"):
        SlurmJoin(slurm_conf="ClusterName=c\nSlurmctldHost=ctl\n")
    with pytest.raises(ValueError, match="no SlurmctldHost"):
        SlurmJoin(slurm_conf="MaxNodeCount=4\n")
    with pytest.raises(ValueError, match="slurm.munge_key is not base64"):
        SlurmJoin(slurm_conf=conf, munge_key="not base64 at all!")
    with pytest.raises(ValueError, match=r"slurm.features: \['a b'\]"):
        SlurmJoin(slurm_conf=conf, features=["a b"])
    with pytest.raises(ValueError, match=r"hosts: \['10.0.0.7'\] are not Slurm node names .* set `name`"):
        SshHosts(
            hosts=[SshHost(address="10.0.0.7")],
            credentials=SshCredentials(private_key="k"),
            slurm=SlurmJoin(slurm_conf=conf),
        )
    join = SlurmJoin(slurm_conf=conf + "SlurmdPidFile=/run/slurmd-%n.pid\n", features=["joined"])
    assert join.pid_file("g1") == "/run/slurmd-g1.pid"
    assert gres_type("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gres_type("NVIDIA GeForce RTX 3090") == "geforce_rtx_3090"
    gpus = parse_nvidia_smi("0, NVIDIA A100-SXM4-80GB, 81920, 550.54.15\n1, Tesla T4, 15360, 550.54.15\n")
    assert join.slurmd_argv("g1", gpus) == [
        "slurmd",
        "-f",
        "/etc/slurm/slurm.conf",
        "-N",
        "g1",
        "-Z",
        "--conf",
        "Gres=gpu:a100-sxm4-80gb:1,gpu:tesla_t4:1 Feature=joined",
    ]
    assert join.gres_conf_for("g1", gpus).splitlines()[1:] == [
        "NodeName=g1 Name=gpu Type=a100-sxm4-80gb File=/dev/nvidia0",
        "NodeName=g1 Name=gpu Type=tesla_t4 File=/dev/nvidia1",
    ]


def test_a_controller_that_does_not_answer_fails_the_join_clearly_and_release_stops_slurmd(
    hosts: FakeHosts, joining: tuple[SshHosts, dict[str, str], dict[str, str]]
) -> None:
    block, names, env = joining
    # The cluster's config, but the controller at an address nothing listens on.
    conf = block.slurm.slurm_conf.replace(
        f"SlurmctldHost=localhost({env['SLURM_CTLD_ADDR']})", "SlurmctldHost=localhost(10.231.6.254)"
    )
    assert conf != block.slurm.slurm_conf
    lost = block.model_copy(
        update={
            "hosts": block.hosts[:1],
            "slurm": block.slurm.model_copy(update={"slurm_conf": conf}),
        }
    )
    node = names["a100"]
    nodes = lost.acquire(1, NodeRequirements(), "run-lost")
    with pytest.raises(NodesUnreachable) as info:
        lost.bootstrap(nodes, NodeRequirements(gpus=1))
    assert f"{node}: `scontrol show node` failed" in str(info.value) and "Unable to contact slurm controller" in str(
        info.value
    )
    assert not in_cluster(env, node)  # the real cluster never saw it
    running = slurmd_pid(lost.slurm, node)
    assert running is not None  # slurmd started and keeps trying to register

    with pytest.raises(NodesUnreachable, match=f"{node}: `scontrol show node` failed"):
        lost.release(nodes)
    assert slurmd_pid(lost.slurm, node) is None and not _alive(running)  # stopped all the same
