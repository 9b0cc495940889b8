"""The k8s stack itself (scripts/k8s.sh): `up` again changes nothing, and the node's footprint stays inside the
namespaces the stack made (its iptables rules, its mounts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.stacks import stacks_root

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


def _pids() -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted((stacks_root() / "k8s" / "pids").glob("*.pid"))}


def _in_node_net(k8s: dict[str, str], *cmd: str) -> str:
    return subprocess.run(["nsenter", f"--net={k8s['K8S_NODE_NETNS']}", *cmd], check=True, capture_output=True,
                          text=True, timeout=60).stdout  # fmt: skip


def test_up_again_changes_nothing(k8s: dict[str, str]) -> None:
    # `up` takes its settings from the environment: this test needs the one the stack was started with.
    port = os.environ.get("GPUFERRY_K8S_API_PORT", "16443")
    if not k8s["K8S_API_URL"].endswith(f":{port}"):
        pytest.skip(f"the k8s stack was started with other settings ({k8s['K8S_API_URL']}, not port {port})")
    before, env_before = _pids(), (stacks_root() / "k8s" / "env").read_text()
    assert {"etcd.pid", "kube-apiserver.pid", "kubelet.pid", "kube-proxy.pid", "containerd.pid",
            "fake-gpu-plugin.pid"} <= set(before)  # fmt: skip
    out = subprocess.run(["bash", str(REPO / "scripts" / "k8s.sh"), "up"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "GPUFERRY_STACKS": str(stacks_root())})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "starting" not in out.stderr, out.stderr
    assert _pids() == before
    assert (stacks_root() / "k8s" / "env").read_text() == env_before


def test_the_node_keeps_its_rules_and_mounts_to_its_namespaces(k8s: dict[str, str]) -> None:
    # kube-proxy's Service rules and the kubelet's chains exist, in the node's network namespace only.
    inside = _in_node_net(k8s, "iptables-save", "-t", "nat")
    assert ":KUBE-SERVICES " in inside and ":KUBE-MARK-MASQ " in inside
    host = subprocess.run(["iptables-save"], check=True, capture_output=True, text=True, timeout=60).stdout
    assert "KUBE-" not in host
    # The node's address and routes are there, not on the host.
    assert k8s["K8S_NODE_IP"] in _in_node_net(k8s, "ip", "-o", "-4", "addr")
    host_addrs = subprocess.run(["ip", "-o", "-4", "addr"], check=True, capture_output=True, text=True).stdout
    assert k8s["K8S_NODE_IP"] + "/" not in host_addrs
    # Of the node's mounts (pods' overlays and volumes, the private /run and /var), the host sees none: only
    # the two namespace files and the directory holding them.
    run = str(stacks_root().resolve() / "k8s")
    targets = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], check=True, capture_output=True, text=True).stdout
    ours = sorted(t for t in targets.splitlines() if t.startswith(run + "/"))
    assert ours == [f"{run}/ns", f"{run}/ns/mnt", f"{run}/ns/net"], ours
