"""A kubelet stand-in for the local Kubernetes stack (test infrastructure; started by scripts/k8s.sh).

It registers one node with GPU resources (``nvidia.com/gpu`` and a MIG resource such as
``nvidia.com/mig-1g.10gb``), heartbeats (node status + Lease, so the node lifecycle controller keeps
it Ready and untainted) and brings the pods scheduled to it to Running/Ready:

* podman mode (``KUBELET_DOCKER_HOST`` set: the registry stack's podman API socket): the pod's first
  container really runs, its port published on a loopback port (the pod's annotation
  ``kubelet-standin.gpuferry.io/host-port`` says which); readiness comes from the container's own
  readiness probe (``/readyz``), startup and liveness probes restart it; a failed pull is
  ErrImagePull → ImagePullBackOff, a process that exits is CrashLoopBackOff (OOMKilled when the
  kernel killed it for memory).
* fake mode (no API socket): nothing runs. Pods go Running/Ready at once, except when their image
  cannot be pulled: a registry host that cannot resolve (``*.invalid``), or a loopback registry
  that does not have the manifest → ErrImagePull → ImagePullBackOff.

Environment: KUBELET_API_URL, KUBELET_CA_FILE, KUBELET_CERT_FILE, KUBELET_KEY_FILE, K8S_NODE,
K8S_NODE_GPUS, K8S_NODE_MIG_PROFILE, K8S_NODE_MIG_COUNT, KUBELET_DOCKER_HOST, KUBELET_STATE_DIR.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("kubelet-standin")
HOST_PORT_ANNOTATION = "kubelet-standin.gpuferry.io/host-port"
NODE_LABEL = "kubelet-standin.gpuferry.io/node"
KUBELET_VERSION = os.environ.get("K8S_VERSION", "v1.20.2")
MERGE = {"Content-Type": "application/merge-patch+json"}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Api:
    def __init__(self) -> None:
        ctx = ssl.create_default_context(cafile=os.environ["KUBELET_CA_FILE"])
        ctx.load_cert_chain(os.environ["KUBELET_CERT_FILE"], os.environ["KUBELET_KEY_FILE"])
        self.client = httpx.Client(base_url=os.environ["KUBELET_API_URL"], verify=ctx, timeout=15.0)

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             params: dict[str, Any] | None = None) -> httpx.Response:  # fmt: skip
        for attempt in range(5):
            try:
                return self.client.request(
                    method, path, params=params, headers=headers,
                    content=None if body is None else json.dumps(body).encode(),
                )  # fmt: skip
            except httpx.TransportError as exc:
                log.warning("%s %s: %s (attempt %d)", method, path, exc, attempt + 1)
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"{method} {path}: API server unreachable")


# ---------------------------------------------------------------------------------------- the node


class Node:
    def __init__(self, api: Api, name: str, runtime: str) -> None:
        self.api, self.name, self.runtime = api, name, runtime
        gpus = os.environ.get("K8S_NODE_GPUS", "4")
        mig = os.environ.get("K8S_NODE_MIG_PROFILE", "1g.10gb")
        self.resources = {
            "cpu": "32", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi",
            "nvidia.com/gpu": gpus, f"nvidia.com/mig-{mig}": os.environ.get("K8S_NODE_MIG_COUNT", "7"),
        }  # fmt: skip

    def status(self) -> dict[str, Any]:
        stamp = now()

        def cond(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": stamp, "lastTransitionTime": self.started}  # fmt: skip

        return {
            "capacity": self.resources,
            "allocatable": self.resources,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                cond("Ready", "True", "KubeletReady", f"kubelet stand-in is posting ready status ({self.runtime})"),
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": os.uname().release,
                "osImage": "gpuferry kubelet stand-in", "containerRuntimeVersion": self.runtime,
                "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": KUBELET_VERSION,
                "operatingSystem": "linux", "architecture": "amd64",
            },
        }  # fmt: skip

    def register(self) -> None:
        self.started = now()
        body = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": {
                "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true", "nvidia.com/mig.strategy": "mixed", NODE_LABEL: "true",
            }},
        }  # fmt: skip
        r = self.api.call("POST", "/api/v1/nodes", body)
        if r.status_code not in (201, 409):
            raise RuntimeError(f"registering node {self.name}: {r.status_code} {r.text}")
        self.heartbeat()
        log.info("node %s registered: %s", self.name, self.resources)

    def heartbeat(self) -> None:
        r = self.api.call("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": self.status()}, MERGE)
        if r.status_code != 200:
            log.warning("node status: %s %s", r.status_code, r.text[:300])
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": now_micro()}
        r = self.api.call("PATCH", lease_path, {"spec": spec}, MERGE)
        if r.status_code == 404:
            r = self.api.call("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                              {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": self.name}, "spec": spec})  # fmt: skip
        if r.status_code not in (200, 201):
            log.warning("lease: %s %s", r.status_code, r.text[:300])


# ---------------------------------------------------------------------------------------- images


def registry_of(image: str) -> tuple[str, str, str]:
    """(registry host, repository, tag or digest) of an image reference."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = "docker.io", image
    if "@" in path:
        repo, ref = path.split("@", 1)
    else:
        last = path.rsplit("/", 1)[-1]
        repo, ref = (path.rsplit(":", 1) if ":" in last else (path, "latest"))
    return host, repo, ref


def simulated(image: str) -> bool:
    """Images of example.com registries (a reserved documentation domain) never run: their pods only
    get a status, in podman mode too. Tests of the control plane's side use them."""
    host = registry_of(image)[0].rsplit(":", 1)[0]
    return host == "example.com" or host.endswith(".example.com")


def fake_pull(image: str) -> str | None:
    """None when the image 'pulls'; else the error message a kubelet would show."""
    host, repo, ref = registry_of(image)
    hostname = host.rsplit(":", 1)[0]
    if hostname.endswith(".invalid"):
        return f'Failed to pull image "{image}": dial tcp: lookup {hostname}: no such host'
    if hostname in ("127.0.0.1", "localhost"):
        try:
            r = httpx.head(
                f"http://{host}/v2/{repo}/manifests/{ref}", timeout=5,
                headers={"Accept": "application/vnd.oci.image.manifest.v1+json, "
                                   "application/vnd.docker.distribution.manifest.v2+json, "
                                   "application/vnd.oci.image.index.v1+json, "
                                   "application/vnd.docker.distribution.manifest.list.v2+json"},
            )  # fmt: skip
        except httpx.HTTPError as exc:
            return f'Failed to pull image "{image}": {exc}'
        if r.status_code != 200:
            return f'Failed to pull image "{image}": manifest unknown ({r.status_code})'
    return None


# ---------------------------------------------------------------------------------------- pods


@dataclass
class Probe:
    spec: dict[str, Any]
    successes: int = 0
    failures: int = 0
    last: float = 0.0

    def due(self, started: float) -> bool:
        t = time.monotonic()
        if t - started < self.spec.get("initialDelaySeconds", 0):
            return False
        return t - self.last >= self.spec.get("periodSeconds", 10)

    def run(self, host_port: int | None, port_names: dict[str, int]) -> bool:
        self.last = time.monotonic()
        http = self.spec.get("httpGet")
        ok = True
        if http and host_port:
            try:
                r = httpx.get(f"http://127.0.0.1:{host_port}{http.get('path', '/')}",
                              timeout=self.spec.get("timeoutSeconds", 1))  # fmt: skip
                ok = 200 <= r.status_code < 400
            except httpx.HTTPError:
                ok = False
        if ok:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1
        return ok


@dataclass
class PodState:
    uid: str
    namespace: str
    name: str
    ip: str
    start_time: str = field(default_factory=now)
    container_id: str | None = None
    host_port: int | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restart_count: int = 0
    waiting: dict[str, str] | None = None
    last_terminated: dict[str, Any] | None = None
    ready: bool = False
    started: bool = False
    next_try: float = 0.0
    backoff: float = 10.0
    pull_failures: int = 0
    probes: dict[str, Probe] = field(default_factory=dict)
    sent: str = ""
    annotated: bool = False


class Kubelet:
    def __init__(self) -> None:
        self.api = Api()
        self.node_name = os.environ.get("K8S_NODE", "gpu-node-1")
        docker_host = os.environ.get("KUBELET_DOCKER_HOST", "")
        self.docker = None
        if docker_host:
            import docker

            self.docker = docker.DockerClient(base_url=docker_host, timeout=120)
            version = self.docker.version().get("Version", "?")
            runtime = f"podman://{version}"
        else:
            runtime = "fake://0"
        self.node = Node(self.api, self.node_name, runtime)
        # The node's own registry credentials (what a node's config.json gives a real kubelet).
        self.node_credentials: dict[str, dict[str, str]] = {}
        registry_env = os.environ.get("KUBELET_REGISTRY_ENV", "")
        if registry_env and os.path.exists(registry_env):
            settings = dict(line.split("=", 1) for line in open(registry_env).read().splitlines() if "=" in line)
            if settings.get("REGISTRY_URL") and settings.get("REGISTRY_PASSWORD_FILE"):
                password = open(settings["REGISTRY_PASSWORD_FILE"]).read().strip()
                self.node_credentials[settings["REGISTRY_URL"]] = {
                    "username": settings.get("REGISTRY_USER", ""), "password": password}
        self.pods: dict[str, PodState] = {}
        self.next_ip = 2
        self.stop = threading.Event()

    # -- lifecycle
    def run(self) -> None:
        self.node.register()
        if self.docker:
            self._remove_leftovers()
        threading.Thread(target=self._heartbeats, daemon=True).start()
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception:
                log.exception("sync failed")
            self.stop.wait(0.5)
        for state in list(self.pods.values()):
            self._kill(state)

    def _heartbeats(self) -> None:
        while not self.stop.wait(10):
            try:
                self.node.heartbeat()
            except Exception:
                log.exception("heartbeat failed")

    def _remove_leftovers(self) -> None:
        for c in self.docker.containers.list(all=True, filters={"label": f"{NODE_LABEL}={self.node_name}"}):
            log.info("removing leftover container %s", c.name)
            try:
                c.remove(force=True)
            except Exception:
                log.exception("removing %s", c.name)

    # -- the sync loop
    def sync(self) -> None:
        r = self.api.call("GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node_name}"})
        r.raise_for_status()
        seen = set()
        for pod in r.json().get("items", []):
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            if pod["metadata"].get("deletionTimestamp"):
                self._delete(pod)
                continue
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            state = self.pods.get(uid)
            if state is None:
                state = self.pods[uid] = PodState(uid, pod["metadata"]["namespace"], pod["metadata"]["name"],
                                                  ip=f"10.244.{self.next_ip // 250}.{self.next_ip % 250 + 2}")  # fmt: skip
                self.next_ip += 1
                log.info("pod %s/%s scheduled here", state.namespace, state.name)
            self._sync_pod(pod, state)
            self._report(pod, state)
        for uid in set(self.pods) - seen:
            self._kill(self.pods.pop(uid))

    def _delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        state = self.pods.pop(meta["uid"], None)
        if state:
            self._kill(state, grace=min(pod["spec"].get("terminationGracePeriodSeconds", 30), 10))
        r = self.api.call("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                           "preconditions": {"uid": meta["uid"]}})  # fmt: skip
        if r.status_code not in (200, 404, 409):
            log.warning("final delete of %s: %s %s", meta["name"], r.status_code, r.text[:200])
        else:
            log.info("pod %s/%s deleted", meta["namespace"], meta["name"])

    def _kill(self, state: PodState, grace: int = 5) -> None:
        if self.docker and state.container_id:
            try:
                c = self.docker.containers.get(state.container_id)
                c.stop(timeout=grace)
                c.remove(force=True)
            except Exception as exc:
                log.info("stopping %s: %s", state.name, exc)
            state.container_id = None

    def _sync_pod(self, pod: dict[str, Any], state: PodState) -> None:
        container = pod["spec"]["containers"][0]
        if time.monotonic() < state.next_try:
            return
        if self.docker is None or simulated(container["image"]):
            if state.started:
                return
            error = fake_pull(container["image"])
            if error:
                self._pull_failed(state, error)
                return
            state.waiting, state.started, state.ready = None, True, True
            state.started_at = now()
            return
        self._sync_container(pod, container, state)

    def _pull_failed(self, state: PodState, error: str) -> None:
        state.pull_failures += 1
        if state.pull_failures == 1:
            state.waiting = {"reason": "ErrImagePull", "message": error}
            state.next_try = time.monotonic() + 1
        else:
            state.waiting = {"reason": "ImagePullBackOff", "message": f"Back-off pulling image: {error}"}
            state.next_try = time.monotonic() + min(10 * 2 ** (state.pull_failures - 2), 300)

    # -- podman mode
    def _sync_container(self, pod: dict[str, Any], container: dict[str, Any], state: PodState) -> None:
        import docker.errors

        if state.container_id is None:
            image = container["image"]
            try:
                try:
                    self.docker.images.get(image)
                except docker.errors.ImageNotFound:
                    log.info("pulling %s", image)
                    self.docker.images.pull(image, auth_config=self._auth_for(pod, image))
            except docker.errors.APIError as exc:
                self._pull_failed(state, f'Failed to pull image "{image}": {exc.explanation or exc}')
                return
            self._start(pod, container, state)
            return
        try:
            c = self.docker.containers.get(state.container_id)
        except docker.errors.NotFound:
            state.container_id = None
            return
        if c.status in ("exited", "dead", "stopped"):
            info = c.attrs.get("State", {})
            code = info.get("ExitCode", 1)
            reason = "OOMKilled" if info.get("OOMKilled") else ("Completed" if code == 0 else "Error")
            state.last_terminated = {"exitCode": code, "reason": reason, "startedAt": state.started_at,
                                     "finishedAt": now(), "containerID": f"podman://{state.container_id}"}  # fmt: skip
            log.info("pod %s: container exited %s (%s)", state.name, code, reason)
            try:
                c.remove(force=True)
            except Exception:
                pass
            state.container_id, state.ready, state.started = None, False, False
            state.restart_count += 1
            state.waiting = {"reason": "CrashLoopBackOff",
                             "message": f"back-off {state.backoff:.0f}s restarting failed container={container['name']} pod={state.name}"}  # fmt: skip
            state.next_try = time.monotonic() + state.backoff
            state.backoff = min(state.backoff * 2, 300)
            return
        self._probe(pod, container, state, c)

    def _auth_for(self, pod: dict[str, Any], image: str) -> dict[str, str] | None:
        """Credentials for the image's registry: the pod's imagePullSecrets, else the node's own."""
        host = registry_of(image)[0]
        for ref in pod["spec"].get("imagePullSecrets", []):
            r = self.api.call("GET", f"/api/v1/namespaces/{pod['metadata']['namespace']}/secrets/{ref['name']}")
            if r.status_code != 200:
                continue
            data = r.json().get("data", {})
            raw = data.get(".dockerconfigjson") or data.get(".dockercfg")
            if not raw:
                continue
            config = json.loads(base64.b64decode(raw))
            auths = config.get("auths", config)
            entry = auths.get(host) or auths.get(f"http://{host}") or auths.get(f"https://{host}")
            if entry:
                if "auth" in entry and "username" not in entry:
                    user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
                    return {"username": user, "password": password}
                return {"username": entry.get("username", ""), "password": entry.get("password", "")}
        return self.node_credentials.get(host)

    def _start(self, pod: dict[str, Any], container: dict[str, Any], state: PodState) -> None:
        env = {}
        for source in container.get("envFrom", []):
            name = source.get("secretRef", {}).get("name")
            if name:
                r = self.api.call("GET", f"/api/v1/namespaces/{state.namespace}/secrets/{name}")
                if r.status_code != 200:
                    state.waiting = {"reason": "CreateContainerConfigError", "message": f'secret "{name}" not found'}
                    state.next_try = time.monotonic() + 5
                    return
                env.update({k: base64.b64decode(v).decode() for k, v in r.json().get("data", {}).items()})
        env.update({e["name"]: e.get("value", "") for e in container.get("env", []) if "value" in e})
        ports = container.get("ports", [])
        publish, state.host_port = {}, None
        if ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                state.host_port = s.getsockname()[1]
            publish = {f"{ports[0]['containerPort']}/tcp": ("127.0.0.1", state.host_port)}
        volumes = {}
        for mount in container.get("volumeMounts", []):
            vol = next((v for v in pod["spec"].get("volumes", []) if v["name"] == mount["name"]), {})
            if "hostPath" in vol:
                volumes[vol["hostPath"]["path"]] = {"bind": mount["mountPath"], "mode": "ro" if mount.get("readOnly") else "rw"}
        limits = container.get("resources", {}).get("limits", {})
        kwargs: dict[str, Any] = {}
        if "memory" in limits:
            kwargs["mem_limit"] = _bytes(limits["memory"])
        c = self.docker.containers.run(
            container["image"], command=container.get("args"), entrypoint=container.get("command"),
            environment=env, ports=publish, volumes=volumes, detach=True,
            name=f"k8s_{state.namespace}_{state.name}_{state.restart_count}",
            labels={NODE_LABEL: self.node_name, "io.kubernetes.pod.uid": state.uid}, **kwargs,
        )  # fmt: skip
        state.container_id = c.id
        state.started_at, state.started_mono = now(), time.monotonic()
        state.waiting, state.ready, state.started = None, False, False
        state.probes = {k: Probe(container[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
        log.info("pod %s: started container %s on 127.0.0.1:%s", state.name, c.short_id, state.host_port)
        if not state.annotated and state.host_port:
            self.api.call("PATCH", f"/api/v1/namespaces/{state.namespace}/pods/{state.name}",
                          {"metadata": {"annotations": {HOST_PORT_ANNOTATION: str(state.host_port)}}}, MERGE)  # fmt: skip

    def _probe(self, pod: dict[str, Any], container: dict[str, Any], state: PodState, c: Any) -> None:
        names = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        startup = state.probes.get("startupProbe")
        if not state.started:
            if startup is None:
                state.started = True
            elif startup.due(state.started_mono):
                if startup.run(state.host_port, names):
                    state.started = True
                elif startup.failures >= startup.spec.get("failureThreshold", 3):
                    log.info("pod %s: startup probe failed; restarting", state.name)
                    c.kill()
                return
        if not state.started:
            return
        liveness = state.probes.get("livenessProbe")
        if liveness and liveness.due(state.started_mono) and not liveness.run(state.host_port, names):
            if liveness.failures >= liveness.spec.get("failureThreshold", 3):
                log.info("pod %s: liveness probe failed; restarting", state.name)
                c.kill()
                return
        readiness = state.probes.get("readinessProbe")
        if readiness is None:
            state.ready = True
        elif readiness.due(state.started_mono):
            ok = readiness.run(state.host_port, names)
            if ok and readiness.successes >= readiness.spec.get("successThreshold", 1):
                state.ready = True
            elif not ok and readiness.failures >= readiness.spec.get("failureThreshold", 3):
                state.ready = False

    # -- status
    def _report(self, pod: dict[str, Any], state: PodState) -> None:
        container = pod["spec"]["containers"][0]
        running = state.waiting is None and (state.started or state.container_id is not None)
        cstate: dict[str, Any] = (
            {"running": {"startedAt": state.started_at}} if running else {"waiting": state.waiting or {"reason": "ContainerCreating"}}
        )
        ready = running and state.ready
        cs = {
            "name": container["name"], "image": container["image"], "imageID": container["image"],
            "ready": ready, "started": running and state.started, "restartCount": state.restart_count, "state": cstate,
        }  # fmt: skip
        if state.container_id:
            cs["containerID"] = f"podman://{state.container_id}"
        if state.last_terminated:
            cs["lastState"] = {"terminated": state.last_terminated}
        t = state.start_time

        def cond(kind: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
            out = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": t}
            if not ok and reason:
                out["reason"] = reason
            return out

        status = {
            # A container that ran once keeps the pod Running while it backs off (restartPolicy Always).
            "phase": "Running" if running or state.restart_count else "Pending",
            "hostIP": "127.0.0.1", "podIP": state.ip, "podIPs": [{"ip": state.ip}], "startTime": state.start_time,
            "qosClass": "Burstable",
            "conditions": [cond("Initialized", True), cond("Ready", ready, "ContainersNotReady"),
                           cond("ContainersReady", ready, "ContainersNotReady"), cond("PodScheduled", True)],
            "containerStatuses": [cs],
        }  # fmt: skip
        body = json.dumps(status, sort_keys=True)
        if body == state.sent:
            return
        r = self.api.call("PATCH", f"/api/v1/namespaces/{state.namespace}/pods/{state.name}/status",
                          {"status": status}, MERGE)  # fmt: skip
        if r.status_code == 200:
            state.sent = body
            log.info("pod %s/%s: %s ready=%s %s", state.namespace, state.name, status["phase"], ready,
                     (state.waiting or {}).get("reason", ""))  # fmt: skip
        elif r.status_code != 404:
            log.warning("pod status %s: %s %s", state.name, r.status_code, r.text[:300])


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * units[suffix])
    return int(float(quantity))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    kubelet = Kubelet()
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stop.set())
    signal.signal(signal.SIGINT, lambda *_: kubelet.stop.set())
    kubelet.run()


if __name__ == "__main__":
    main()
