"""The k8s stack itself (scripts/k8s.sh): `up` again changes nothing, the node's footprint stays inside the
namespaces the stack made (its iptables rules, its mounts, the kernel tunables the kubelet sets), and `down` leaves
nothing behind on the host; `up` then brings the node back.

Every run of scripts/k8s.sh here replays the settings the stack was started with (its env file), whatever this
process's environment says.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.stacks import stacks_root

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent

# What the kubelet (1.20) sets at start, each host-wide: pkg/kubelet/cm/container_manager_linux.go,
# setupKernelTunables. kube-proxy (iptables mode) sets route_localnet, which is per network namespace.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
HOST_SYSCTLS = (*KUBELET_SYSCTLS, "net/ipv4/conf/all/route_localnet")


def _pids() -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted((stacks_root() / "k8s" / "pids").glob("*.pid"))}


def _in_node_net(k8s: dict[str, str], *cmd: str) -> str:
    return subprocess.run(
        ["nsenter", f"--net={k8s['K8S_NODE_NETNS']}", *cmd], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def _k8s_sh(k8s: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    """`scripts/k8s.sh COMMAND` with the settings the stack was started with."""
    settings = {
        "GPUFERRY_STACKS": str(stacks_root()),
        "GPUFERRY_K8S_API_PORT": k8s["K8S_API_URL"].rsplit(":", 1)[1],
        "GPUFERRY_K8S_NODE": k8s["K8S_NODE"],
        "GPUFERRY_K8S_NODE_GPUS": k8s["K8S_NODE_GPUS"],
        "GPUFERRY_K8S_NODE_MIG_PROFILE": k8s["K8S_NODE_MIG_RESOURCE"].removeprefix("nvidia.com/mig-"),
        "GPUFERRY_K8S_NODE_MIG_COUNT": k8s["K8S_NODE_MIG_COUNT"],
        "GPUFERRY_K8S_NODE_IP": k8s["K8S_NODE_IP"],
        "GPUFERRY_K8S_POD_CIDR": k8s["K8S_POD_CIDR"],
        "GPUFERRY_K8S_SERVICE_CIDR": k8s["K8S_SERVICE_CIDR"],
        "GPUFERRY_K8S_CGROUP_ROOT": k8s["K8S_CGROUP_ROOT"],
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "k8s.sh"), command],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **settings},
    )


def _kubectl(k8s: dict[str, str], *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        [k8s["K8S_KUBECTL"], "--kubeconfig", k8s["KUBECONFIG"], *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", name).read_text().strip() for name in HOST_SYSCTLS}


def _host_rules() -> list[str]:
    """The host's iptables and ip6tables lines of kubelet, kube-proxy or CNI chains."""
    lines = []
    for save in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([save], check=True, capture_output=True, text=True, timeout=60).stdout
        lines += [line for line in out.splitlines() if re.search(r"KUBE-|CNI-", line)]
    return lines


def _processes() -> dict[tuple[int, str], dict[str, object]]:
    """Every process: (pid, start time) -> its network and mount namespaces, executable and command line."""
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            start = (proc / "stat").read_text().rsplit(")", 1)[1].split()[19]
            net, mnt = (proc / "ns" / "net").stat().st_ino, (proc / "ns" / "mnt").stat().st_ino
            exe = os.readlink(proc / "exe")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or a kernel thread
            continue
        out[(int(proc.name), start)] = {"net": net, "mnt": mnt, "exe": exe, "cmdline": cmdline}
    return out


def _cgroup_procs(pattern: str) -> set[int]:
    pids: set[int] = set()
    for d in glob.glob(pattern, recursive=True):
        for procs in Path(d).rglob("cgroup.procs"):
            pids |= {int(p) for p in procs.read_text().split()}
    return pids


def _of_the_stack(p: dict[str, object], run: str, cache: str) -> bool:
    """A daemon of the stack: one of its binaries (kubectl aside: a client), or containerd, a shim, etcd or a relay
    working on its run directory."""
    exe, cmdline = str(p["exe"]), str(p["cmdline"])
    if exe.startswith(cache + "/"):
        return not os.path.basename(exe).startswith("kubectl")
    daemons = ("containerd", "containerd-shim-runc-v2", "etcd", "socat", "runc")
    return run in cmdline and os.path.basename(exe).split(" ")[0] in daemons


def test_up_again_changes_nothing(k8s: dict[str, str]) -> None:
    before, env_before = _pids(), (stacks_root() / "k8s" / "env").read_text()
    assert {
        "etcd.pid",
        "kube-apiserver.pid",
        "kubelet.pid",
        "kube-proxy.pid",
        "containerd.pid",
        "fake-gpu-plugin.pid",
    } <= set(before)
    out = _k8s_sh(k8s, "up")
    assert out.returncode == 0, out.stderr
    assert "starting" not in out.stderr, out.stderr
    assert _pids() == before
    assert (stacks_root() / "k8s" / "env").read_text() == env_before


def test_the_node_keeps_its_rules_mounts_and_tunables_to_its_namespaces(k8s: dict[str, str]) -> None:
    # kube-proxy's Service rules and the kubelet's chains exist, in the node's network namespace only.
    inside = _in_node_net(k8s, "iptables-save", "-t", "nat")
    assert ":KUBE-SERVICES " in inside and ":KUBE-MARK-MASQ " in inside
    assert _host_rules() == []
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
    # Inside the node, each kernel tunable the kubelet sets is a file of the stack's own holding the value the
    # kubelet wants (so it writes none of them on the host).
    node_mounts = subprocess.run(
        ["nsenter", f"--mount={k8s['K8S_NODE_MNTNS']}", "findmnt", "-rn", "-o", "TARGET"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.splitlines()
    for name, wanted in KUBELET_SYSCTLS.items():
        assert f"/proc/sys/{name}" in node_mounts, name
        seen = subprocess.run(
            ["nsenter", f"--mount={k8s['K8S_NODE_MNTNS']}", "cat", f"/proc/sys/{name}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        assert seen == wanted, name


def test_down_leaves_nothing_behind_and_up_brings_the_node_back(k8s: dict[str, str]) -> None:
    run = str(stacks_root().resolve() / "k8s")
    cache = str(Path(k8s["K8S_KUBECTL"]).resolve().parent.parent)
    env_before, sysctls = (stacks_root() / "k8s" / "env").read_text(), _sysctls()
    root = k8s["K8S_CGROUP_ROOT"]
    # A pod on the node, so that `down` has a pod to take away too (its processes, cgroups, overlay mount).
    name = f"down-{uuid.uuid4().hex[:8]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [{"name": "pause", "image": k8s["K8S_PAUSE_IMAGE"], "imagePullPolicy": "Never"}],
            "terminationGracePeriodSeconds": 0,
        },
    }
    try:
        _kubectl(k8s, "apply", "-f", "-", stdin=json.dumps(pod))
        _kubectl(k8s, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=240s")
        uid = _kubectl(k8s, "get", "pod", name, "-o", "jsonpath={.metadata.uid}").strip()

        node_net, node_mnt = Path(run, "ns", "net").stat().st_ino, Path(run, "ns", "mnt").stat().st_ino
        before = _processes()
        in_node = {key for key, p in before.items() if p["net"] == node_net or p["mnt"] == node_mnt}
        pod_pids = _cgroup_procs(f"/sys/fs/cgroup/*{root}/**/pod{uid}")
        in_pod = {key for key in before if key[0] in pod_pids}
        daemons = {key for key, p in before.items() if _of_the_stack(p, run, cache)}
        assert in_node and in_pod and daemons
        assert _host_rules() == []

        down = _k8s_sh(k8s, "down")
        assert down.returncode == 0, down.stderr

        # No process of the stack is left: none of those in the node, in the pod or of its daemons, none still
        # in the node's namespaces, no daemon of the stack, nothing in its cgroups (which are gone).
        after = _processes()
        assert not (in_node | in_pod | daemons) & set(after)
        # (Only processes older than `down`: a namespace made since may have been given a freed inode number.)
        assert not [
            p["cmdline"] for key, p in after.items() if key in before and (p["net"] == node_net or p["mnt"] == node_mnt)
        ]
        assert not [p["cmdline"] for p in after.values() if _of_the_stack(p, run, cache)]
        assert glob.glob(f"/sys/fs/cgroup/*{root}") == [] and not Path(f"/sys/fs/cgroup{root}").exists()
        # No mount at or below the run directory, nor any naming it (overlays of its containerd).
        assert run not in Path("/proc/self/mountinfo").read_text()
        for gone in ("ns/net", "ns/mnt", "nsfs", "dev", "etcd", "env"):
            assert not Path(run, gone).exists(), gone
        assert _host_rules() == []
        assert _sysctls() == sysctls
    finally:
        up = _k8s_sh(k8s, "up")  # the stack back for the tests after this one, whatever happened above
        subprocess.run(
            [
                k8s["K8S_KUBECTL"],
                "--kubeconfig",
                k8s["KUBECONFIG"],
                "delete",
                "pod",
                name,
                "--ignore-not-found",
                "--wait=false",
            ],
            capture_output=True,
            timeout=60,
        )
    assert up.returncode == 0, up.stderr
    assert (stacks_root() / "k8s" / "env").read_text() == env_before
    # The node is back: Ready, untainted, its GPUs and MIG slices advertised; the host still untouched.
    node = json.loads(_kubectl(k8s, "get", "node", k8s["K8S_NODE"], "-o", "json"))
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True" and not node["spec"].get("taints")
    allocatable = node["status"]["allocatable"]
    assert allocatable["nvidia.com/gpu"] == k8s["K8S_NODE_GPUS"]
    assert allocatable[k8s["K8S_NODE_MIG_RESOURCE"]] == k8s["K8S_NODE_MIG_COUNT"]
    assert _host_rules() == []
    assert _sysctls() == sysctls
