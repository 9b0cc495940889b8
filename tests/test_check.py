"""`gpuferry check` against the local stacks: all green, then each backend made unreachable in turn.

The shared stacks are never stopped (other tests use them): a backend is "down" by pointing its block at a
port where nothing listens (what a stopped server looks like from here: connection refused), or at a listener
of this test's own that accepts and never answers (a hung server, which only the deadline ends). Wrong
settings (a user, an account, a QoS, a container runtime, a bucket, a namespace the systems do not have) are
checked against the real systems. The failed row names the check and the fix, every other backend's rows stay
ok, and the whole check returns within its deadline (with slack for a busy machine: a bound on behaviour, not
a speed measurement; bench/check_wall.py measures the speed).

Permissions and workers: tests/test_check_refusals.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from blocks.base.proc import free_port
from blocks.checks import PROBE_PREFIX, CheckRow
from blocks.storage.s3 import S3CheckpointStore
from deployments import skeleton
from tests.checking import GREEN, checked, prefect_api, steps, table  # noqa: F401 - fixtures
from tests.stack_files import write
from tests.stacks import stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


def test_the_check_command_is_all_green_on_the_local_stacks(steps: dict[str, Any], tmp_path: Path) -> None:
    path = write(tmp_path / "stack.yaml", {"local": steps})
    skeleton.write(tmp_path / "house-prices")
    env = {**os.environ, "PREFECT_API_URL": stack_env("prefect")["PREFECT_API_URL"]}
    started = time.monotonic()
    # A generous deadline per backend: this machine is shared, and what is checked here is that every row is
    # green, not how fast (the wall time is printed; the default deadline is 10 s).
    done = subprocess.run(
        [
            str(REPO / ".venv/bin/gpuferry"),
            "check",
            "-f",
            str(path),
            "--json",
            "--timeout",
            "60",
            "--workload",
            str(tmp_path / "house-prices"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    rows = [CheckRow(**r) for r in report["rows"]]
    assert report["ok"] is True
    assert [r for r in rows if r.status not in GREEN] == [], table(rows)
    checks = {(r.step, r.check) for r in rows}
    assert {
        ("compute", "SSH host key"),
        ("compute", "SSH login"),
        ("compute", "Slurm version"),
        ("compute", "partitions"),
        ("compute", "GPUs (gres)"),
        ("compute", "account/QoS"),
        ("compute", "container runtime"),
        ("compute", "store's Python"),
        ("compute", "store from the login node"),
        ("storage", "put, get, delete"),
        ("tracking", "registry"),
        ("tracking", "webhooks"),
        ("images", "registry login"),
        ("images", "push permission"),
        ("serving", "RBAC"),
        ("serving", "GPU nodes"),
        ("prefect", "online worker"),
        ("workload", "run plan"),
    } <= checks
    print(f"gpuferry check: {wall:.1f} s wall, {report['seconds']} s after start-up, {len(rows)} checks")


def table_rows(out: str) -> list[list[str]]:
    """The cells of each row of the table `gpuferry check` prints (a cell wrapped over several lines, joined)."""
    rows: list[list[str]] = []
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return rows


def test_the_check_command_exits_1_with_the_failed_row_and_its_fix(steps: dict[str, Any], tmp_path: Path) -> None:
    """The installed command on a stack whose MLflow server is down: the table, then --json, as a user reads them."""
    changed = copy.deepcopy(steps)
    port = free_port()
    changed["tracking"]["tracking_uri"] = f"http://127.0.0.1:{port}"
    path = write(tmp_path / "stack.yaml", {"local": changed})
    env = {**os.environ, "PREFECT_API_URL": stack_env("prefect")["PREFECT_API_URL"]}
    command = [str(REPO / ".venv/bin/gpuferry"), "check", "-f", str(path), "--timeout", "60"]
    detail = f"127.0.0.1:{port}: nothing listens there (connection refused)"
    fix = "start the MLflow server, or fix tracking_uri"

    printed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 1, printed.stdout[-5000:] + printed.stderr[-3000:]
    rows = table_rows(printed.stdout)
    assert [r for r in rows if r[3] != "ok"] == [["tracking", "MlflowTracking", "reach", "FAILED", detail, fix]], (
        printed.stdout
    )
    assert {r[0] for r in rows} == {"provider", "images", "compute", "storage", "tracking", "serving", "prefect"}
    assert re.search(rf"stack local: 1 check\(s\) failed \({len(rows)} checks in [\d.]+ s\)", printed.stdout)

    as_json = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert as_json.returncode == 1, as_json.stdout[-5000:] + as_json.stderr[-3000:]
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["stack"] == "local"
    failed = [r for r in report["rows"] if r["status"] != "ok"]
    assert [(r["step"], r["check"], r["status"], r["detail"], r["fix"]) for r in failed] == [
        ("tracking", "reach", "failed", detail, fix)
    ]
    assert len(report["rows"]) - len(failed) >= 20  # every other backend's rows, all ok


def test_the_checks_leave_nothing_behind(steps: dict[str, Any], tmp_path: Path, s3_store: S3CheckpointStore) -> None:
    rows = checked(steps, tmp_path, prefect=False)
    assert not [r for r in rows if r.failed], table(rows)
    client = s3_store.bucket.credentials.get_s3_client()
    listed = client.list_objects_v2(Bucket=s3_store.bucket.bucket_name).get("Contents", [])
    assert [o["Key"] for o in listed if PROBE_PREFIX in o["Key"]] == []
    registry = stack_env("registry")
    catalog = httpx.get(
        f"http://{registry['REGISTRY_URL']}/v2/_catalog",
        timeout=30,
        auth=(registry["REGISTRY_USER"], Path(registry["REGISTRY_PASSWORD_FILE"]).read_text().strip()),
    ).json()
    assert steps["images"]["repository"] not in catalog.get("repositories", [])  # the upload was cancelled


def _kubeconfig_at(path: Path, server: str) -> str:
    config = yaml.safe_load(Path(stack_env("k8s")["KUBECONFIG"]).read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = server
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _other_key(tmp: Path) -> str:
    """A known_hosts line for the login node's address with a key it does not have."""
    import paramiko

    env = stack_env("slurm")
    path = tmp / "known_hosts"
    key = paramiko.Ed25519Key.from_private_key_file(env["SLURM_SSH_KEY"])  # any ed25519 key but the host's
    path.write_text(f"[{env['SLURM_SSH_HOST']}]:{env['SLURM_SSH_PORT']} ssh-ed25519 {key.get_base64()}\n")
    return str(path)


def _down(tmp: Path) -> dict[str, Callable[[dict[str, Any]], tuple[str, str, str, str]]]:
    """Case → a change to the steps, and the (step, check, what the detail says, what the fix says)."""
    port = free_port()

    def slurm(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["port"] = port
        return "compute", "SSH reach", "nothing listens there", "check host and port"

    def host_key(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["credentials"]["known_hosts"] = {"file": _other_key(tmp)}
        return "compute", "SSH host key", "CHANGED", "ssh-keyscan -p"

    def ssh_user(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["credentials"]["user"] = "gpuferry-no-such-user"  # the login node's sshd refuses the key for it
        return "compute", "SSH login", "SSH login as gpuferry-no-such-user@", "check user and private_key"

    def account(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["account"] = "gpuferry-no-such-account"
        user = stack_env("slurm")["SLURM_SSH_USER"]
        return (
            "compute",
            "account/QoS",
            f"user {user!r} is not in account 'gpuferry-no-such-account'",
            "set account to one of: ",
        )

    def qos(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["qos"] = "gpuferry-no-such-qos"
        return "compute", "account/QoS", "QoS 'gpuferry-no-such-qos' is not allowed", "set qos to one of: high, normal"

    def runtime(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["container_runtime"] = "apptainer"  # the stack's nodes have podman only
        return (
            "compute",
            "container runtime",
            "no apptainer on the login node's PATH; the cluster offers: podman",
            "install apptainer on the nodes, or set container_runtime to podman or auto",
        )

    def partition(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["partition"] = "gpu-a100"
        return "compute", "partitions", "partition 'gpu-a100' does not exist", "set partition to one of: debug"

    def store_python(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["compute"]["store_python"] = "/nonexistent/python3"
        return "compute", "store's Python", "/nonexistent/python3 on the login node", "install boto3 and PyYAML"

    def s3(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["storage"]["bucket"]["credentials"]["aws_client_parameters"]["endpoint_url"] = f"http://127.0.0.1:{port}"
        return "storage", "reach", "nothing listens there", "start the S3 server"

    def bucket(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["storage"]["bucket"]["bucket_name"] = "gpuferry-no-such-bucket"
        return "storage", "bucket", "does not exist", "aws s3 mb s3://gpuferry-no-such-bucket"

    def mlflow(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["tracking"]["tracking_uri"] = f"http://127.0.0.1:{port}"
        return "tracking", "reach", "nothing listens there", "start the MLflow server"

    def registry(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["images"]["credentials"]["registry_url"] = f"http://127.0.0.1:{port}"
        return "images", "reach", "nothing listens there", "start the registry"

    def password(s: dict[str, Any]) -> tuple[str, str, str, str]:
        (tmp / "wrong-password").write_text("not-the-password\n")
        s["images"]["credentials"]["password"] = {"file": str(tmp / "wrong-password")}
        return "images", "registry login", "refused the credentials", "fix credentials.username / credentials.password"

    def engine(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["images"]["docker_host"]["base_url"] = f"unix://{tmp}/no-such.sock"
        return "images", "engine", "", "start the engine"

    def kubernetes(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["serving"]["kubeconfig"] = {"file": _kubeconfig_at(tmp / "kubeconfig", f"https://127.0.0.1:{port}")}
        return "serving", "reach", "", "start the API server"

    def namespace(s: dict[str, Any]) -> tuple[str, str, str, str]:
        s["serving"]["namespace"] = "gpuferry-no-such-namespace"
        return "serving", "namespace", "does not exist", "kubectl create namespace gpuferry-no-such-namespace"

    return {
        f.__name__: f
        for f in (
            slurm,
            host_key,
            ssh_user,
            partition,
            account,
            qos,
            runtime,
            store_python,
            s3,
            bucket,
            mlflow,
            registry,
            password,
            engine,
            kubernetes,
            namespace,
        )
    }


CASES = [
    "slurm",
    "host_key",
    "ssh_user",
    "partition",
    "account",
    "qos",
    "runtime",
    "store_python",
    "s3",
    "bucket",
    "mlflow",
    "registry",
    "password",
    "engine",
    "kubernetes",
    "namespace",
]


# A store nothing answers for fails the login node's own check of it too (it stores the trained model itself).
ALSO_FAILS = {"s3": (("compute", "store from the login node"),)}


@pytest.mark.parametrize("case", CASES)
def test_a_backend_down_fails_its_row_with_the_fix_and_the_others_stay_ok(
    case: str, steps: dict[str, Any], tmp_path: Path
) -> None:
    changed = copy.deepcopy(steps)
    step, check, detail, fix = _down(tmp_path)[case](changed)
    rows = checked(changed, tmp_path, prefect=False)
    failed = [r for r in rows if r.failed and (r.step, r.check) not in ALSO_FAILS.get(case, ())]
    assert [(r.step, r.check) for r in failed] == [(step, check)], table(rows)
    assert detail in failed[0].detail and fix in failed[0].fix, table(failed)
    also = {(r.step, r.check) for r in rows if r.failed} - {(step, check)}
    assert also == set(ALSO_FAILS.get(case, ())), table(rows)
    others = [r for r in rows if r.step != step and r.status not in GREEN and (r.step, r.check) not in also]
    assert others == [], table(rows)


def test_the_prefect_server_down_fails_its_row(steps: dict[str, Any], tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        rows = checked(steps, tmp_path, work_pool="gpuferry")
    failed = [r for r in rows if r.failed]
    assert [(r.step, r.check) for r in failed] == [("prefect", "server")], table(rows)
    assert "PREFECT_API_URL" in failed[0].fix


@pytest.mark.usefixtures("prefect_api")
def test_a_missing_work_pool_names_the_command_that_creates_it(steps: dict[str, Any], tmp_path: Path) -> None:
    rows = checked(steps, tmp_path, work_pool="gpuferry-no-such-pool")
    failed = [r for r in rows if r.failed]
    assert [(r.step, r.check) for r in failed] == [("prefect", "work pool")], table(rows)
    assert "prefect work-pool create gpuferry-no-such-pool" in failed[0].fix


class Silent:
    """A TCP listener that accepts connections and never answers: a hung server."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.server.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


def _hanging(port: int, tmp: Path) -> dict[str, Callable[[dict[str, Any]], set[tuple[str, str]]]]:
    """Case → a change pointing backends at the silent listener, and the (step, check) rows that must fail."""

    def ssh_and_s3(s: dict[str, Any]) -> set[tuple[str, str]]:
        s["compute"]["host"], s["compute"]["port"] = "127.0.0.1", port  # the login node has an address of its own
        s["storage"]["bucket"]["credentials"]["aws_client_parameters"]["endpoint_url"] = f"http://127.0.0.1:{port}"
        return {("compute", "SSH host key"), ("storage", "bucket")}  # the TCP connection opens: the next check waits

    def mlflow(s: dict[str, Any]) -> set[tuple[str, str]]:
        s["tracking"]["tracking_uri"] = f"http://127.0.0.1:{port}"
        return {("tracking", "server")}

    def registry(s: dict[str, Any]) -> set[tuple[str, str]]:
        s["images"]["credentials"]["registry_url"] = f"http://127.0.0.1:{port}"
        return {("images", "registry login")}

    def kubernetes(s: dict[str, Any]) -> set[tuple[str, str]]:
        s["serving"]["kubeconfig"] = {"file": _kubeconfig_at(tmp / "kubeconfig", f"https://127.0.0.1:{port}")}
        return {("serving", "reach")}  # the TLS handshake gets no answer

    return {f.__name__: f for f in (ssh_and_s3, mlflow, registry, kubernetes)}


HANG_TIMEOUT_S = 30.0  # the deadline of every backend in these runs, the ones that answer included (a busy machine)


@pytest.mark.parametrize("case", ["ssh_and_s3", "mlflow", "registry", "kubernetes", "prefect"])
def test_a_backend_that_hangs_fails_within_its_timeout_and_holds_up_no_other(
    case: str, steps: dict[str, Any], tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    silent = Silent()
    try:
        changed = copy.deepcopy(steps)
        if case == "prefect":
            expected = {("prefect", "server")}
            with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{silent.port}/api"}):
                rows = checked(changed, tmp_path, timeout=HANG_TIMEOUT_S, work_pool="gpuferry")
        else:
            expected = _hanging(silent.port, tmp_path)[case](changed)
            rows = checked(changed, tmp_path, timeout=HANG_TIMEOUT_S, prefect=False)  # bounded: see checked()
    finally:
        silent.close()
    failed = {(r.step, r.check): r for r in rows if r.failed}
    assert set(failed) == expected, table(rows)
    for row in failed.values():
        assert (
            f"within {HANG_TIMEOUT_S:.0f} s" in row.detail
            or "timed out" in row.detail.lower()
            or "timeout" in row.detail.lower()
        ), table(rows)
    hung = {step for step, _ in expected}
    assert [r for r in rows if r.step not in hung and r.status not in GREEN] == [], table(rows)
