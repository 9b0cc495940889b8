"""Test helpers for the k8s stack's node (scripts/k8s.sh): its image pull secret, a service's pods, what a pod's
container sees (its variables, its GPU device nodes), sockets inside the node's network namespace, a relay from
there to a server on the host's loopback, and a steady load through a Service's ClusterIP from inside the node.

Traffic to pod IPs and ClusterIPs starts only inside the node's network namespace, which the stack itself
created (its path is the stack's ``K8S_NODE_NETNS``). A thread enters it with setns(2), which moves only that
thread; a socket belongs for good to the namespace it was made in, whichever thread uses it later.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import selectors
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.stacks import Relay

PULL_SECRET = "registry-pull"  # the image pull secret every test namespace gets (tests/conftest.py)
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def pull_secret(registry: dict[str, str]) -> dict[str, Any]:
    """A kubernetes.io/dockerconfigjson Secret with the registry stack's credentials, as a cluster admin makes one."""
    user, password = registry["REGISTRY_USER"], Path(registry["REGISTRY_PASSWORD_FILE"]).read_text().strip()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    config = {"auths": {registry["REGISTRY_URL"]: {"username": user, "password": password, "auth": auth}}}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": PULL_SECRET},
        "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()},
    }


def pods(block: Any, name: str) -> list[dict[str, Any]]:
    """The pods of the KubernetesCluster ``block``'s service object ``name``."""
    from blocks.kubernetes import manifests as k8s_manifests

    path = f"/api/v1/namespaces/{block.namespace}/pods"
    return block._api().get(path, labelSelector=k8s_manifests.label_selector(name))["items"]


def ready_pods(block: Any, name: str) -> list[dict[str, Any]]:
    """Those of ``pods`` that are Ready and not terminating."""
    return [
        p
        for p in pods(block, name)
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
    ]


def in_pod(k8s: dict[str, str], namespace: str, pod: dict[str, Any], *cmd: str) -> str:
    """What ``cmd`` prints inside the pod's container (kubectl exec through the API server and the kubelet)."""
    out = subprocess.run(
        [
            k8s["K8S_KUBECTL"],
            "--kubeconfig",
            k8s["KUBECONFIG"],
            "-n",
            namespace,
            "exec",
            pod["metadata"]["name"],
            "--",
            *cmd,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def in_pod_env(k8s: dict[str, str], namespace: str, pod: dict[str, Any], name: str) -> str:
    """A variable of the pod's container, read inside it."""
    return in_pod(k8s, namespace, pod, "printenv", name)


_NVIDIA_NODES = """
import os, stat
for root, _, files in os.walk("/dev"):
    for f in files:
        st = os.lstat(os.path.join(root, f))
        if f.startswith("nvidia") and stat.S_ISCHR(st.st_mode):
            print(os.path.join(root, f), os.major(st.st_rdev), os.minor(st.st_rdev))
"""


def in_pod_gpu_nodes(k8s: dict[str, str], namespace: str, pod: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The NVIDIA character devices in the pod's /dev (path -> major, minor)."""
    lines = in_pod(k8s, namespace, pod, "python", "-c", _NVIDIA_NODES).splitlines()
    return {path: (int(major), int(minor)) for path, major, minor in (line.split() for line in lines)}


def _enter_netns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(path: str, fn: Callable[[], T]) -> T:
    """``fn()`` run on a fresh thread inside the network namespace at ``path``; its result or its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            _enter_netns(path)
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class NodeRelay(Relay):
    """Listens inside the node on ``host``:<free port> and relays each connection to ``target`` on this
    machine's loopback: how pods reach a server of another stack (``address`` is what to give them)."""

    def __init__(self, netns: str, host: str, target: tuple[str, int]) -> None:
        self.netns = netns
        super().__init__(host, target)

    def _listen(self, host: str) -> socket.socket:
        return in_netns(self.netns, lambda: socket.create_server((host, 0)))  # connections go out from the host


class TlsNodeRelay(NodeRelay):
    """A ``NodeRelay`` that speaks TLS to the pods with ``certificate``/``key`` (a certificate for the node's address)
    and plain TCP to ``target``: an https endpoint at the node's address in front of a store on loopback. Counts the
    TLS handshakes that passed and those that failed (a client that did not trust the certificate). One thread per
    connection moves both directions (an SSL connection is not used by two threads at once)."""

    def __init__(self, netns: str, host: str, target: tuple[str, int], certificate: Path, key: Path) -> None:
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(certificate, key)
        self.handshakes, self.refused = 0, 0
        super().__init__(netns, host, target)

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        try:
            pod = self.tls.wrap_socket(client, server_side=True)
        except (OSError, ssl.SSLError):
            self.refused += 1
            client.close()
            return
        self.handshakes += 1
        try:
            upstream = socket.create_connection(self.target, timeout=30)
        except OSError:
            pod.close()
            return
        with pod, upstream, selectors.DefaultSelector() as sel:
            sel.register(pod, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, pod)
            try:
                while True:
                    for key, _ in sel.select(timeout=300) or [(None, None)]:
                        if key is None:
                            return  # idle: the pod's client keeps no connection that long
                        src, dst = key.fileobj, key.data
                        data = src.recv(65536)
                        while isinstance(src, ssl.SSLSocket) and src.pending():  # decrypted, not seen by select
                            data += src.recv(src.pending())
                        if not data:
                            return
                        dst.sendall(data)
            except (OSError, ssl.SSLError):
                return


@dataclass
class Answer:
    at: float  # seconds since the load started
    path: str
    status: int | None  # None: no HTTP answer (the error says why)
    error: str = ""
    body: Any = None


@dataclass
class ServiceLoad:
    """A steady load on ``url`` (a Service's ClusterIP) from inside the node: ``rate`` requests per second,
    alternating ``POST /invocations`` with ``body`` and ``GET /`` (which names the model that answered), for at
    most ``max_requests`` requests and ``max_seconds`` seconds, on one keep-alive client as a caller would."""

    netns: str
    url: str
    body: dict[str, Any]
    rate: float = 20.0
    max_requests: int = 4000
    max_seconds: float = 240.0
    timeout: float = 10.0
    answers: list[Answer] = field(default_factory=list)
    t0: float = 0.0  # time.monotonic() when the load started: Answer.at counts from here
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def start(self) -> ServiceLoad:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(self.timeout + 5)
        if self._error:
            raise self._error
        return self.answers

    @property
    def failed(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]

    def models(self) -> list[tuple[float, str]]:
        """(when, the served checkpoint's sha256) of every ``GET /`` answer."""
        return [
            (a.at, a.body["model"]["checkpoint_sha256"])
            for a in self.answers
            if a.path == "/" and a.status == 200 and isinstance(a.body, dict) and a.body.get("model")
        ]

    def _run(self) -> None:
        try:
            _enter_netns(self.netns)
            started = self.t0
            with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
                for i in range(self.max_requests):
                    due = started + i / self.rate
                    if self._stop.wait(max(0.0, due - time.monotonic())) or due - started > self.max_seconds:
                        return
                    path = "/invocations" if i % 2 == 0 else "/"
                    at = time.monotonic() - started
                    try:
                        r = client.post(path, json=self.body) if path == "/invocations" else client.get(path)
                        self.answers.append(Answer(at, path, r.status_code, body=r.json()))
                    except (httpx.HTTPError, ValueError) as exc:
                        self.answers.append(Answer(at, path, None, error=f"{type(exc).__name__}: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - kept and raised by the thread that joins this one
            self._error = exc


def write_test_models(root: Path, hidden: tuple[int, ...] = (16, 24, 32)) -> dict[str, int]:
    """Small MLflow models under ``root`` (model-16/, model-24/, ...: an MLP of that hidden width taking 64
    features, saved with mlflow.pytorch), each with its manifest, readable by the pods. Returns each model's
    sha256 (what the server's ``/readyz`` names) -> its hidden width."""
    import mlflow.pytorch
    import numpy as np
    import torch
    from torch import nn

    from blocks.base.storage import write_manifest

    models: dict[str, int] = {}
    for width in hidden:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10), nn.Softmax(dim=1)).eval()
        path = root / f"model-{width}"
        mlflow.pytorch.save_model(
            net, str(path), input_example=np.zeros((2, 64), dtype=np.float32), pip_requirements=["torch"]
        )
        models[write_manifest(path)] = width  # the server serves only a checkpoint with a manifest
    for p in (root, *root.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return models
