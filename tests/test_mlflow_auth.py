"""The tracking block against an MLflow server that requires a login, started here: `mlflow server --app-name
basic-auth` on a free loopback port, its runs and its users in SQLite files of its own. It takes MLflow's basic
auth and a bearer token (tests/mlflow_token_auth.py).

With the right login the block logs a run and registers a model version; a wrong login, none, or an account
without the permission fails at the first request with a ConfigurationError naming the block's fields, and the
task is not retried. A training job on the local backend logs into the run with the login it reads from a 0600
file; the password is found on no command line, in no file the backend leaves, in no MLflow param or tag and in
none of the flow run's Prefect logs. The webhook receiver's `--register` logs in as the saved stack's tracking
block does, and falls back to MLflow's variables for a block without a login.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mlflow.exceptions import MlflowException
from prefect import flow
from prefect.client.orchestration import get_client
from pydantic import SecretStr

from blocks.base.compute import inherited_environment
from blocks.base.proc import free_port
from blocks.errors import ConfigurationError
from blocks.local.compute import LocalProcesses
from blocks.records import CheckpointRef, CodeRef, TrainingJob
from blocks.tracking.mlflow import MlflowTracking
from runtime import contract
from tasks.retry import is_transient
from tasks.track import finish_run, start_run
from tasks.train import train
from tests.examples import REPO
from tests.planted import CommandLines, flow_run_logs, send_logs_now
from tests.private_worker import wait_until
from tests.processes import stop_process_group

ADMIN = "admin"


@dataclass(frozen=True)
class AuthServer:
    uri: str
    password: str  # the admin's
    token: str  # the admin's bearer token
    reader: str  # a user with the default permission (READ) only; its password is reader_password
    reader_password: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    root = tmp_path_factory.mktemp("mlflow-auth")
    password, token = f"planted-pw-{uuid.uuid4().hex}", f"planted-token-{uuid.uuid4().hex}"
    ini = root / "basic_auth.ini"
    ini.write_text(
        textwrap.dedent(f"""\
        [mlflow]
        default_permission = READ
        database_uri = sqlite:///{root}/basic_auth.db
        admin_username = {ADMIN}
        admin_password = {password}
        authorization_function = tests.mlflow_token_auth:authenticate
        """)
    )
    ini.chmod(0o600)
    port = free_port()
    env = {
        **inherited_environment(),
        "PYTHONPATH": str(REPO),
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex,
        "GPUFERRY_TEST_MLFLOW_TOKEN": token,
        # webhooks to a loopback receiver (test_the_webhook_registers_with_the_stacks_login)
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        "GPUFERRY_TEST_MLFLOW_TOKEN_USER": ADMIN,
    }
    argv = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--app-name",
        "basic-auth",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root}/mlflow.db",
        "--artifacts-destination",
        (root / "artifacts").as_uri(),
    ]
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"mlflow server exited {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}"
            )
        try:
            return httpx.get(f"{uri}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until("the MLflow server with basic auth", healthy, timeout=240)
        # The server requires a login: an anonymous request is refused.
        assert httpx.get(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30).status_code == 401
        reader, reader_password = "reader", f"reader-{uuid.uuid4().hex}"
        made = httpx.post(
            f"{uri}/api/2.0/mlflow/users/create",
            json={"username": reader, "password": reader_password},
            auth=(ADMIN, password),
            timeout=30,
        )
        assert made.status_code == 200, made.text
        yield AuthServer(uri, password, token, reader, reader_password)
    finally:
        stop_process_group(proc)  # the server and the workers it started
        log.close()


def _checkpoint(tag: str) -> CheckpointRef:
    # The registry records the checkpoint's URI; the server does not read it.
    return CheckpointRef(uri=f"s3://models/checkpoints/{tag}", sha256="0" * 64, size_bytes=10, files=1)


@pytest.mark.parametrize("login", ["basic", "token"])
def test_a_login_logs_a_run_and_registers_a_version(
    server: AuthServer, login: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)  # only the block's login counts
    given = (
        {"username": ADMIN, "password": SecretStr(server.password)}
        if login == "basic"
        else {"token": SecretStr(server.token)}
    )
    tracking = MlflowTracking(tracking_uri=server.uri, **given)
    tag = uuid.uuid4().hex[:8]
    run_id = tracking.start_run(f"auth-{tag}", f"retrain-{tag}", {"prefect.flow_run_id": tag})
    tracking.log(run_id, params={"lr": 0.1}, metrics={"val_accuracy": 0.9})
    version = tracking.register(f"auth-{tag}", run_id, _checkpoint(tag), "val_accuracy", 0.9)
    tracking.set_alias(f"auth-{tag}", "champion", version)
    tracking.end_run(run_id)
    assert tracking.run_metrics(run_id) == {"val_accuracy": 0.9}
    assert tracking.resolve_version(f"auth-{tag}", alias="champion") == (version, f"s3://models/checkpoints/{tag}")
    # The login went with the requests only: this process's environment does not hold it.
    assert not {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"} & set(os.environ)
    # What a job gets to log in with.
    secrets = {k: v.get_secret_value() for k, v in tracking.job_secrets().items()}
    assert secrets == (
        {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": server.password}
        if login == "basic"
        else {"MLFLOW_TRACKING_TOKEN": server.token}
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {},
            r"requires a login \(HTTP 401\) and the tracking block has none: set tracking.username \+ "
            r"tracking.password \(basic auth\) or tracking.token",
        ),
        (
            {"username": ADMIN, "password": "wrong"},
            r"refused the login of tracking.username='admin' and its "
            r"password \(HTTP 401\): fix tracking.username",
        ),
        ({"token": "wrong"}, r"refused the login of tracking.token \(HTTP 401\)"),
    ],
)
def test_a_refused_login_fails_at_once_naming_the_fields(
    server: AuthServer, given: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    tracking = MlflowTracking(tracking_uri=server.uri, http_max_retries=10, **given)
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match=message) as refused:
        tracking.start_run("auth-refused", "refused", {})
    # MLflow does not retry a refusal (10 retries with backoff would take minutes), and neither do the tasks.
    assert time.monotonic() - started < 20
    assert not is_transient(refused.value)
    assert server.password not in str(refused.value)


def test_an_account_without_the_permission_is_told_so(server: AuthServer) -> None:
    admin = MlflowTracking(tracking_uri=server.uri, username=ADMIN, password=SecretStr(server.password))
    run_id = admin.start_run(f"auth-admins-{uuid.uuid4().hex[:8]}", "admins", {})
    reader = MlflowTracking(tracking_uri=server.uri, username=server.reader, password=SecretStr(server.reader_password))
    assert reader.run_metrics(run_id) == {}  # it may read
    with pytest.raises(
        ConfigurationError,
        match=r"refused the request \(HTTP 403.*tracking.username='reader' "
        r"and its password lacks the permission",
    ):
        reader.log(run_id, metrics={"x": 1.0})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"username": ADMIN, "password": "refused-value", "token": "t"},
            "give username \\+ password \\(basic auth\\) or token",
        ),
        ({"username": ADMIN}, "tracking.username and tracking.password go together"),
        ({"password": "refused-value"}, "tracking.username and tracking.password go together"),
        ({"token": "t", "tracking_uri": "sqlite:///mlflow.db"}, "is a local store: point tracking_uri at the server"),
    ],
)
def test_credentials_are_checked_when_the_block_is_made(given: dict, message: str) -> None:
    given = {"tracking_uri": "http://127.0.0.1:5000", **given}
    with pytest.raises(ValueError, match=message) as refused:
        MlflowTracking(**given)
    assert "refused-value" not in str(refused.value)  # a refused value is not repeated


# A training job that logs to the server with the login its backend hands it (and checks how it got it).
JOB = """import os, stat, sys
from pathlib import Path
from mlflow import MlflowClient
secret_file = Path(os.environ["CHECKPOINT_DIR"]).parent / ".secret.env"
mode = stat.S_IMODE(secret_file.stat().st_mode)
password = os.environ["MLFLOW_TRACKING_PASSWORD"].encode()
assert password not in Path("/proc/self/cmdline").read_bytes()
assert password in secret_file.read_bytes()
print(f"login from {secret_file.name}, mode {mode:o}", flush=True)
MlflowClient().log_metric(os.environ["MLFLOW_RUN_ID"], "logged_by_job", 1.0)
"""


@flow(name="auth-training")
def _logged_training(tracking: MlflowTracking, compute: LocalProcesses, code: str, key: str) -> str:
    run_id = start_run(tracking, "auth-training", key, params={"lr": 0.1}, tags={})
    job = TrainingJob(
        key=key,
        workdir=compute.job_workdir(key),
        command=["python", "job.py"],
        env={contract.MLFLOW_TRACKING_URI: tracking.tracking_uri, contract.MLFLOW_RUN_ID: run_id},
        secret_env=tracking.job_secrets(),
        code=CodeRef(root=code, archive=f"{code}/unused.tar.gz", sha256="0" * 64),
    )
    train(compute, job, timeout_seconds=300)
    finish_run(tracking, run_id)
    return run_id


@pytest.mark.usefixtures("prefect_server")
def test_a_local_job_logs_in_with_its_secret_file_and_the_password_is_nowhere_else(
    server: AuthServer, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text(JOB)
    compute = LocalProcesses(workdir_root=str(tmp_path / "jobs"), poll_interval_max=0.5)
    tracking = MlflowTracking(tracking_uri=server.uri, username=ADMIN, password=SecretStr(server.password))
    key = f"auth-{uuid.uuid4().hex[:8]}"
    send_logs_now()
    lines = CommandLines()
    try:
        state = _logged_training(tracking, compute, str(code), key, return_state=True)
    finally:
        seen = lines.stop()
    run_id = state.result()
    assert len(seen) > 10  # the sampler saw the processes

    run = tracking.client.get_run(run_id)
    assert run.data.metrics["logged_by_job"] == 1.0  # the job logged in with the login it was handed
    workdir = Path(compute.job_workdir(key))
    assert "login from .secret.env, mode 600" in (workdir / "job.log").read_text()
    assert not (workdir / ".secret.env").exists()  # removed when the job ended

    messages = flow_run_logs(state.state_details.flow_run_id, until="login from .secret.env, mode 600")
    with get_client(sync_client=True) as prefect:
        parameters = json.dumps(prefect.read_flow_run(state.state_details.flow_run_id).parameters, default=str)
    assert any("login from .secret.env, mode 600" in m for m in messages)  # the job's output reached the logs
    places: dict[str, list[bytes]] = {
        "a command line": list(seen),
        "the flow run's Prefect logs": [m.encode() for m in messages],
        "the flow run's parameters": [parameters.encode()],
        "the MLflow run's params and tags": [
            f"{k}={v}".encode() for k, v in {**run.data.params, **run.data.tags}.items()
        ],
        "a file the backend left": [p.read_bytes() for p in workdir.rglob("*") if p.is_file()],
    }
    for place, contents in places.items():
        assert not [c for c in contents if server.password.encode() in c], f"the password in {place}"


@pytest.mark.parametrize("login", ["basic", "token", "none"])
def test_the_check_logs_in_as_the_block_does(server: AuthServer, login: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from blocks.checks import Probe

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    given = {
        "basic": {"username": ADMIN, "password": SecretStr(server.password)},
        "token": {"token": SecretStr(server.token)},
        "none": {},
    }[login]
    rows = {row.check: row for row in MlflowTracking(tracking_uri=server.uri, **given).self_check(Probe("track", "x"))}
    if login == "none":
        refused = [row for row in rows.values() if row.status == "failed"]
        assert refused and "HTTP 401" in refused[0].detail, rows
        assert "tracking.username + tracking.password" in refused[0].fix
    else:
        assert rows["tracking"].status == "ok" and rows["registry"].status == "ok", rows


@pytest.mark.usefixtures("prefect_server")
def test_the_webhook_registers_with_the_stacks_login(server: AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from blocks.stack import Stack
    from deployments.webhook import find_webhook, register_webhook, stack_tracking, unregister_webhook

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    stack = Stack.embedded()
    stack.tracking = MlflowTracking(tracking_uri=server.uri, username=ADMIN, password=SecretStr(server.password))
    name = f"auth-webhook-{uuid.uuid4().hex[:8]}"
    stack.save(name)
    # `--stack NAME --register`: the saved block's server and login (MLflow lets admins only manage webhooks).
    tracking = stack_tracking(name)
    assert (tracking.tracking_uri, tracking.username) == (server.uri, ADMIN)
    webhook_id = register_webhook(tracking, "http://127.0.0.1:9/mlflow", "s3cr3t", name)
    assert (
        find_webhook(stack_tracking(name, server.uri.replace("127.0.0.1", "localhost")), name).webhook_id == webhook_id
    )
    # A block without a login: MLflow's own variables, as for every MlflowTracking.
    anonymous = MlflowTracking(tracking_uri=server.uri)
    with pytest.raises(MlflowException, match=r"401"):  # MLflow's webhook calls bypass the store's refusal message
        find_webhook(anonymous, name)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    assert unregister_webhook(MlflowTracking(tracking_uri=server.uri), name)
    assert find_webhook(tracking, name) is None
    with pytest.raises(ValueError, match=r"a local store without webhooks"):
        stack_tracking("")
