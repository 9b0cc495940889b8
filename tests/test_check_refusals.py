"""`gpuferry check` rows that no stopped server shows: what the systems refuse a user, and a pool's workers.

A ServiceAccount of the local Kubernetes cluster with half of the permissions a deploy needs, a work pool on
the Prefect stack's server without a worker and then with one gone offline. The one row no local system can
fail is push permission: the registry stack authenticates with htpasswd, which grants every user it knows
push and pull on every repository; a registry of this test's own answers as token-auth registries (Harbor,
GitLab, Docker Hub) do when the user may log in but not push.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from blocks.checks import CheckRow
from tests.checking import GREEN, checked, prefect_api, steps, table  # noqa: F401 - fixtures
from tests.stacks import stack_env

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_pool(prefect_api: str) -> Iterator[str]:
    """A work pool of this test's own on the Prefect stack's server, with no worker; deleted after."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    name = f"gpuferry-check-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="process"))
    yield name
    with get_client(sync_client=True) as client:
        client.delete_work_pool(name)


def test_a_pool_without_an_online_worker_says_how_to_start_one(
    steps: dict[str, Any], tmp_path: Path, empty_pool: str
) -> None:
    from prefect.client.orchestration import get_client

    def worker_row() -> CheckRow:
        rows = checked(steps, tmp_path, work_pool=empty_pool)
        failed = [r for r in rows if r.failed]
        assert [(r.step, r.check) for r in failed] == [("prefect", "online worker")], table(rows)
        assert f"python -m deployments.worker --pool {empty_pool}" in failed[0].fix
        return failed[0]

    assert f"no worker of pool {empty_pool!r} is online (0 known, none polling)" == worker_row().detail

    # A worker that polled once and stopped: the server marks it offline once it misses its heartbeats.
    with get_client(sync_client=True) as client:
        client.send_worker_heartbeat(empty_pool, "stopped-worker", heartbeat_interval_seconds=1)
        deadline = time.monotonic() + 120  # the server's check of heartbeats runs every 15 s
        while (workers := client.read_workers_for_work_pool(empty_pool)) and str(
            getattr(workers[0].status, "value", workers[0].status)
        ).upper() != "OFFLINE":
            assert time.monotonic() < deadline, f"the server never marked the worker offline: {workers}"
            time.sleep(1)
    assert len(workers) == 1
    assert f"no worker of pool {empty_pool!r} is online (1 known, none polling)" == worker_row().detail


def _restricted_kubeconfig(tmp: Path, namespace: str) -> str:
    """A kubeconfig of a ServiceAccount that may get and patch Deployments and Services and list Pods in
    ``namespace``, and nothing else (a deploy that makes the store's Secret needs 14 permissions: this grants 5)."""
    import base64

    from pydantic import SecretStr

    from blocks.kubernetes.cluster import KubernetesCluster

    admin = Path(stack_env("k8s")["KUBECONFIG"]).read_text()
    api = KubernetesCluster(kubeconfig=SecretStr(admin))._api()
    base, rbac = f"/api/v1/namespaces/{namespace}", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    try:
        api.request(
            "POST",
            f"{base}/serviceaccounts",
            body={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "deployer"}},
        )
        api.request(
            "POST",
            f"{rbac}/roles",
            body={
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "half-a-deploy"},
                "rules": [
                    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]},
                    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "patch"]},
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                ],
            },
        )
        api.request(
            "POST",
            f"{rbac}/rolebindings",
            body={
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "deployer"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "half-a-deploy"},
                "subjects": [{"kind": "ServiceAccount", "name": "deployer", "namespace": namespace}],
            },
        )
        # Kubernetes 1.20's token controller gives the account a token Secret of its own: wait for it.
        deadline = time.monotonic() + 120
        while not (secrets := api.get(f"{base}/serviceaccounts/deployer").get("secrets")):
            assert time.monotonic() < deadline, "the ServiceAccount got no token Secret"
            time.sleep(0.5)
        token = base64.b64decode(api.get(f"{base}/secrets/{secrets[0]['name']}")["data"]["token"]).decode()
    finally:
        api.close()
    config = yaml.safe_load(admin)
    for user in config["users"]:
        user["user"] = {"token": token}
    path = tmp / "deployer.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_missing_deploy_permissions_are_named_with_the_role_that_grants_them(
    steps: dict[str, Any], tmp_path: Path, k8s_namespace: str
) -> None:
    changed = copy.deepcopy(steps)
    changed["serving"]["kubeconfig"] = {"file": _restricted_kubeconfig(tmp_path, k8s_namespace)}
    changed["serving"]["namespace"] = k8s_namespace
    rows = checked(changed, tmp_path, prefect=False)
    assert [(r.step, r.check) for r in rows if r.failed] == [("serving", "RBAC")], table(rows)
    serving = {r.check: r for r in rows if r.step == "serving"}
    assert serving["RBAC"].detail == (
        f"13 of 18 permissions missing in {k8s_namespace}: get namespaces, list nodes, delete deployments.apps, "
        "delete services, list replicasets.apps, get configmaps, patch configmaps, delete configmaps, patch pods, "
        "get secrets, create secrets, update secrets, delete secrets"
    )
    assert serving["RBAC"].fix.startswith(
        f"grant them, e.g. kubectl -n {k8s_namespace} create role gpuferry-deploy "
        "--verb=create,delete,get,list,patch,update --resource=configmaps,deployments.apps,namespaces,nodes,pods,"
        "replicasets.apps,secrets,services and a rolebinding"
    )
    # What the account may not read is a warning pointing at the RBAC row, not a second failure.
    assert serving["namespace"].status == "warn" and serving["GPU nodes"].status == "warn", table(rows)
    assert [r for r in rows if r.step != "serving" and r.status not in GREEN] == [], table(rows)


class PullOnlyRegistry:
    """A registry API of this test's own that answers as token-auth registries (Harbor, GitLab, Docker Hub) do
    for a user who may log in and pull but not push: /v2/ and the token endpoint take the login, and a blob
    upload with the token is denied (HTTP 403, DENIED)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def answer(self, status: int, body: dict[str, Any], scope: str = "") -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 401:
                    host, port = self.server.server_address[:2]
                    scope = f',scope="{scope}"' if scope else ""
                    self.send_header(
                        "WWW-Authenticate", f'Bearer realm="http://{host}:{port}/token",service="pull-only"{scope}'
                    )
                self.end_headers()
                self.wfile.write(data)

            def bearer(self) -> bool:
                return self.headers.get("Authorization") == "Bearer pull-only"

            def do_GET(self) -> None:  # http.server's name
                if self.path.startswith("/token"):
                    basic = self.headers.get("Authorization", "").startswith("Basic ")
                    self.answer(200 if basic else 401, {"token": "pull-only"} if basic else {})
                elif self.path == "/v2/":
                    self.answer(200 if self.bearer() else 401, {})
                else:
                    self.answer(404, {"errors": [{"code": "NOT_FOUND"}]})

            def do_POST(self) -> None:
                repository = self.path.removeprefix("/v2/").split("/blobs/")[0]
                if not self.bearer():
                    self.answer(401, {"errors": [{"code": "UNAUTHORIZED"}]}, f"repository:{repository}:pull,push")
                else:
                    self.answer(
                        403, {"errors": [{"code": "DENIED", "message": "requested access to the resource is denied"}]}
                    )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_login_without_push_permission_fails_the_push_row(steps: dict[str, Any], tmp_path: Path) -> None:
    registry = PullOnlyRegistry()
    try:
        changed = copy.deepcopy(steps)
        changed["images"]["credentials"]["registry_url"] = registry.url
        rows = checked(changed, tmp_path, prefect=False)
    finally:
        registry.close()
    failed = [r for r in rows if r.failed]
    assert [(r.step, r.check) for r in failed] == [("images", "push permission")], table(rows)
    user, repository = stack_env("registry")["REGISTRY_USER"], steps["images"]["repository"]
    assert f"does not let {user!r} push to {repository} (HTTP 403)" in failed[0].detail
    assert failed[0].fix == f"grant {user!r} push on {repository}"
    assert {r.check: r.status for r in rows if r.step == "images"}["registry login"] == "ok"
    assert [r for r in rows if r.step != "images" and r.status not in GREEN] == [], table(rows)
