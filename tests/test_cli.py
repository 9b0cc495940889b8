"""The `gpuferry` command on the embedded stack: `init` writes a workload that passes `check` and runs.

Runs the command's own code in this process (typer's runner) against the session's Prefect test server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deployments import skeleton
from deployments.cli import app
from tests.examples import DIABETES

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("prefect_server")]
REPO = Path(__file__).resolve().parent.parent


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_init_writes_a_workload_that_passes_check_and_runs(tmp_path: Path) -> None:
    from blocks.local.serving import LocalServing

    workload = tmp_path / "house-prices"
    code, out = run("init", str(workload))
    assert code == 0 and sorted(p.name for p in workload.iterdir()) == [
        ".dockerignore",
        ".gitignore",
        "Dockerfile",
        "gpuferry.yaml",
        "requirements.txt",
        "train.py",
    ]
    code, out = run("check", "--workload", str(workload), "--no-prefect")
    assert code == 0, out
    assert re.search(r"workload\s.*run plan\s.*ok", out) and "all checks passed" in out

    # The run as a user starts it: the installed command, in a process of its own, on the test's server.
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run(
        [
            str(REPO / ".venv/bin/gpuferry"),
            "run",
            "retrain",
            "--workload",
            str(workload),
            "--local",
            "--hp",
            "alpha=0.5",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "model version: house-prices v1 (val_rmse=" in out and "promoted" in out
    url = re.search(r"endpoint: (http://\S+)", out)
    assert url is not None, out
    try:
        example = {
            "dataframe_split": {
                "columns": ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"],
                "data": [[0.0] * 10],
            }
        }
        answer = httpx.post(f"{url.group(1)}/invocations", json=example, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 1
        # Serving the champion again changes nothing: the same server answers at the same address.
        again = subprocess.run(
            [str(REPO / ".venv/bin/gpuferry"), "run", "deploy", "--model", "house-prices", "--local"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
        assert f"endpoint: {url.group(1)}" in again.stdout
    finally:
        LocalServing().undeploy("house-prices")


def test_init_keeps_what_exists_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("# mine\n")
    written = skeleton.write(tmp_path, name="mine")
    assert sorted(p.name for p in written) == [
        ".dockerignore",
        ".gitignore",
        "Dockerfile",
        "gpuferry.yaml",
        "requirements.txt",
    ]
    assert (tmp_path / "train.py").read_text() == "# mine\n"
    assert "name: mine" in (tmp_path / "gpuferry.yaml").read_text()
    skeleton.write(tmp_path, name="mine", force=True)
    assert "def main()" in (tmp_path / "train.py").read_text()
    with pytest.raises(Exception, match="--name"):
        skeleton.write(tmp_path / "x", name="Not A Name")


def test_a_run_on_a_stack_that_is_not_saved_lists_the_saved_ones(tmp_path: Path) -> None:
    skeleton.write(tmp_path / "w")
    code, out = run("run", "retrain", "--workload", str(tmp_path / "w"), "--stack", "no-such-stack", "--local")
    assert code == 2 and "stack='no-such-stack': no saved Stack block has that name; saved stacks:" in out
    code, out = run("check", "no-such-stack", "--no-prefect")
    assert code == 2 and "no saved Stack block" in out


def test_bad_run_options_name_the_option() -> None:
    code, out = run("run", "sweep", "--workload", "examples/diabetes", "--local")
    assert code == 2 and "a sweep needs a grid: --grid NAME=V1,V2" in out
    code, out = run("run", "retrain", "--workload", "examples/diabetes", "--local", "--hp", "alpha")
    assert code == 2 and "--hp 'alpha': write NAME=VALUE" in out


def test_deploy_registers_the_bundled_examples_from_wherever_gpuferry_is_installed(tmp_path: Path) -> None:
    """Without --workload: prefect.yaml's deployments, each example's workload by absolute path into the examples
    shipped with gpuferry (no clone needed); with --workload: the workload's retrain and sweep, the retrain on its
    train.schedule or --cron; the deployments no workload owns (on-champion, provision, release) come apart."""
    import yaml

    from deployments import cli_deploy

    config = yaml.safe_load(cli_deploy.PREFECT_FILE.read_text())
    bundled = cli_deploy.bundled_deployments(config, skeleton.EXAMPLES_DIR)
    workloads = [d["parameters"]["workload"] for d in bundled if "workload" in d["parameters"]]
    assert workloads and all(Path(w).is_absolute() and (Path(w) / "gpuferry.yaml").is_file() for w in workloads)
    shared = {f"{cli_deploy.flow_of(d['entrypoint'])}/{d['name']}" for d in cli_deploy.shared_deployments(config)}
    assert shared == {"deploy-model/on-champion", "provision/provision", "release/release"}

    work = tmp_path / "house-prices"
    skeleton.write(work, name="house-prices")
    text = (work / "gpuferry.yaml").read_text().replace("train:\n", "train:\n  schedule: {cron: '0 3 * * 1'}\n", 1)
    (work / "gpuferry.yaml").write_text(text)
    retrain, sweep = cli_deploy.workload_deployments(config, [str(work)], stack="hpc")
    assert (retrain["name"], retrain["entrypoint"]) == ("house-prices", "flows/retrain.py:retrain")
    assert retrain["schedules"] == [{"cron": "0 3 * * 1", "timezone": "UTC"}] and "schedules" not in sweep
    assert retrain["parameters"] == {"workload": str(work), "stack": "hpc"} == sweep["parameters"]
    (asked, _) = cli_deploy.workload_deployments(config, [str(work)], cron="30 1 * * *", timezone="Europe/Berlin")
    assert asked["schedules"] == [{"cron": "30 1 * * *", "timezone": "Europe/Berlin"}]
    with pytest.raises(Exception, match=r"train.schedule.cron='30 1 \* \*': write five fields"):
        cli_deploy.workload_deployments(config, [str(work)], cron="30 1 * *")
    (work / "gpuferry.yaml").write_text(text.replace("'0 3 * * 1'}", "'0 3 * * 1', timezone: Mars/Base}"))
    code, out = run("check", "--workload", str(work), "--no-prefect")
    assert code != 0 and "train.schedule.timezone='Mars/Base': give an IANA time zone" in out, out
    code, out = run("deploy", "--cron", "0 3 * * 1")
    assert code == 2 and "name the workload with --workload DIR" in out, out


def test_the_pytorch_template_trains_resumes_and_serves(tmp_path: Path) -> None:
    """`gpuferry init --template pytorch`: a torch job that checkpoints, resumes after exit 75, and whose MLflow
    model the embedded stack stores, registers and serves (the docs' PyTorch guide starts here)."""
    import signal
    import sys
    import time

    from blocks.local.serving import LocalServing
    from blocks.specs import TrainingSpec
    from flows.retrain import retrain

    workload = tmp_path / "torch-model"
    code, out = run("init", str(workload), "--template", "pytorch")
    assert code == 0, out
    assert "name: torch-model" in (workload / "gpuferry.yaml").read_text()
    assert "import torch" in (workload / "train.py").read_text()

    # Stopped by SIGTERM, the job saves a checkpoint and exits 75; started again, it resumes from it.
    checkpoints = tmp_path / "checkpoints"
    env = {**os.environ, "CHECKPOINT_DIR": str(checkpoints), "HPARAMS": '{"epochs": 100000}', "CHECKPOINT_EVERY": "5"}
    env.pop("MLFLOW_TRACKING_URI", None)
    job = subprocess.Popen(
        [sys.executable, "train.py"], cwd=workload, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while not list(checkpoints.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 75, output
    assert (checkpoints / "PREEMPTED").is_file() and "preempted: saved a checkpoint" in output
    again = subprocess.run(
        [sys.executable, "train.py"],
        cwd=workload,
        env={**env, "HPARAMS": '{"epochs": 1}'},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "resumed from step-" in again.stdout, again.stdout + again.stderr

    # The whole pipeline on the embedded stack: trained, stored, registered, promoted and served.
    result = retrain(workload=str(workload), training=TrainingSpec(hyperparameters={"epochs": 2}))
    try:
        assert result.model_version.promoted and result.deployed, result
        assert result.model_version.metric == "val_accuracy"
        url = str(result.endpoint.url).rstrip("/")
        answer = httpx.post(f"{url}/invocations", json={"inputs": [[0.0] * 8, [1.0] * 8]}, timeout=60)
        assert answer.status_code == 200, answer.text
        probabilities = answer.json()["predictions"]
        assert len(probabilities) == 2 and all(abs(sum(row) - 1) < 1e-4 for row in probabilities)
    finally:
        LocalServing().undeploy("torch-model")


@pytest.mark.parametrize("example", ["digits", "diabetes"])
def test_init_writes_a_bundled_example(tmp_path: Path, example: str) -> None:
    from blocks.workload.source import load_workload

    code, out = run("init", str(tmp_path / example), "--example", example, "--name", f"my-{example}")
    assert code == 0, out
    written = {p.name for p in (tmp_path / example).iterdir()}
    assert written == {p.name for p in (REPO / "examples" / example).iterdir() if p.is_file()}
    work = load_workload(str(tmp_path / example))
    assert work.name == f"my-{example}"
    assert (tmp_path / example / "train.py").read_text() == (REPO / "examples" / example / "train.py").read_text()
    code, out = run("init", str(tmp_path / "x"), "--example", "nope")
    assert code == 2 and "--example 'nope': give one of diabetes, digits" in out


def gpuferry(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: ``main()`` in a process of its own (its exit code, its stderr)."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from deployments.cli import main; sys.argv[0] = 'gpuferry'; main()", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_version_and_short_help() -> None:
    version = gpuferry("--version")
    assert version.returncode == 0 and version.stdout.startswith("gpuferry "), version
    short = gpuferry("-h")
    assert short.returncode == 0 and "stack" in short.stdout and "check" in short.stdout, short
    for command in (("check", "-h"), ("run", "retrain", "-h"), ("stack", "apply", "-h"), ("rollout", "promote", "-h")):
        out = gpuferry(*command)
        assert out.returncode == 0 and "Example" in out.stdout, (command, out.stdout)


@pytest.mark.parametrize(
    "command",
    [
        ("stack", "list"),
        ("stack", "show", "hpc"),
        ("check", "hpc"),
        ("run", "retrain", "--workload", str(DIABETES), "--stack", "hpc"),
        ("deploy",),
        ("deploy", "--workload", str(DIABETES)),
        ("runs",),
        ("logs", "clever-fox"),
        ("cancel", "clever-fox"),
        ("services", "--stack", "hpc"),
        ("rollback", "house-prices", "--stack", "hpc"),
        ("serve", "house-prices", "--stack", "hpc"),
        ("gc", "--stack", "hpc"),
        ("rollout", "status", "house-prices", "--stack", "hpc"),
        ("rollout", "abort", "house-prices", "--stack", "hpc"),
    ],
)
def test_an_unreachable_prefect_server_is_two_lines_naming_the_setting(command: tuple[str, ...]) -> None:
    """Every command that talks to Prefect says in two lines which server it could not reach and what to set;
    ``--debug`` shows the traceback."""
    down = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens on port 9
    out = gpuferry(*command, env=down)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out
    assert lines[0].startswith("error: cannot reach the Prefect server at http://127.0.0.1:9/api"), out.stderr
    assert len(lines) == 2 and "PREFECT_API_URL" in lines[1] and "Traceback" not in out.stderr, out.stderr
    debug = gpuferry("--debug", *command, env=down)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConnectError" in debug.stderr


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (("worker",), "--pool"),
        (("watch",), "--interval"),
        (("events",), "--secret-block"),
        (("events", "--poll"), "--alias"),
    ],
)
def test_the_long_running_services_are_commands_of_the_installed_tool(command: tuple[str, ...], option: str) -> None:
    """`gpuferry worker|watch|events` hand their options to the service's own parser (its --help, its errors)."""
    out = gpuferry(*command, "--help")
    assert out.returncode == 0 and option in out.stdout and f"usage: gpuferry {command[0]}" in out.stdout, out
    refused = gpuferry(*command, "--no-such-option", *(["--pool", "p"] if command[0] == "worker" else []))
    assert refused.returncode == 2 and "unrecognized arguments: --no-such-option" in refused.stderr, refused


def test_runs_logs_services_and_rollback() -> None:
    """On the embedded stack: two versions deployed one after the other; `runs` lists the second run with its job
    and version, `logs` prints its log; `services` says v2 serves; `rollback`
    serves v1 again (through deploy-model, as it was registered), moves `champion` to it, and tags v2."""
    import json
    import uuid

    from blocks.specs import ServingSpec, TrainingSpec
    from blocks.stack import Stack
    from flows.retrain import retrain

    model, service = f"diabetes-rollback-{uuid.uuid4().hex[:6]}", f"rb-{uuid.uuid4().hex[:6]}"
    serving = Stack.embedded().serving
    try:
        for alpha in (0.1, 0.2):
            retrain(
                workload=str(DIABETES),
                training=TrainingSpec(model_name=model, hyperparameters={"alpha": alpha}),
                serving=ServingSpec(service_name=service),
                force_deploy=True,
            )
        assert serving.current(service)["version"] == "2"
        code, out = run("runs", "--json", "-n", "5")
        assert code == 0, out
        newest = json.loads(out)[0]  # the second retrain: its labels say what it ran on and what it registered
        assert newest["flow"] == "retrain" and newest["state"] == "Completed", newest
        backend, job_id = newest["job"].split()
        assert newest["stack"] == "" and backend == "gpuferry-local-processes", newest
        assert newest["model_version"].startswith(f"{model} v2 val_rmse="), newest
        assert newest["job_state"] == "", newest  # an ended run's job is not polled
        code, out = run("logs", newest["name"])
        assert code == 0 and f"training job {job_id} on {backend}" in out, out
        code, out = run("logs", "no-such-run-name")
        assert code == 2 and "`gpuferry runs` lists the recent ones" in out, out

        code, out = run("services", "--json")
        assert code == 0, out
        listed = {row["service"]: row for row in json.loads(out)}
        assert listed[service]["model"] == model and listed[service]["version"] == "2", listed

        code, out = run("rollback", service)
        assert code == 0, out
        assert serving.current(service)["version"] == "1"
        tracking = Stack.embedded().tracking
        assert tracking.version_by_alias(model, "champion") == "1"
        assert tracking.version_tags(model, "2")["rollback.to"] == "1"

        code, out = run("rollback", f"{service}-none")
        assert code == 2 and "`gpuferry services` lists what does" in out, out
    finally:
        serving.undeploy(service)


def test_serve_runs_a_registered_version_on_this_machine_with_mlflows_scoring_protocol() -> None:
    """`gpuferry serve MODEL`: the version the alias points at, from the stack's store, checked against the sha256
    the version records, answering POST /invocations until SIGTERM; a model or device that does not exist is a
    short error."""
    import signal
    import time
    import uuid

    from blocks.base.proc import free_port
    from blocks.specs import ServingSpec, TrainingSpec
    from blocks.stack import Stack
    from flows.retrain import retrain

    model = f"diabetes-serve-{uuid.uuid4().hex[:6]}"
    serving = Stack.embedded().serving
    retrain(
        workload=str(DIABETES),
        training=TrainingSpec(model_name=model),
        serving=ServingSpec(service_name=model),
        force_deploy=True,
    )
    serving.undeploy(model)
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from deployments.cli import main; sys.argv[0] = 'gpuferry'; main()"]
    proc = subprocess.Popen(
        [*argv, "serve", model, "--port", str(port), "--device", "cpu"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        ready = None
        while ready is None or ready.status_code != 200:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server was never ready"
            time.sleep(0.5)
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            except httpx.TransportError:
                ready = None
        tags = Stack.embedded().tracking.version_tags(model, "1")
        assert ready.json()["model"]["checkpoint_sha256"] == tags["checkpoint_sha256"]
        columns = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]
        answer = httpx.post(
            f"http://127.0.0.1:{port}/invocations",
            json={"dataframe_split": {"columns": columns, "data": [[0.0] * 10, [0.01] * 10]}},
            timeout=30,
        )
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 2, answer.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        out = proc.stdout.read() if proc.stdout else ""
        assert f"serving {model} v1 (alias 'champion')" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    code, out = run("serve", f"{model}-none")
    assert code == 2 and "has no such alias" in out, out
    code, out = run("serve", model, "--device", "tpu")
    assert code == 2 and "--device 'tpu': give auto, cpu, cuda or cuda:N" in out, out


def test_gc_frees_only_what_no_registered_version_and_no_running_job_uses(tmp_path: Path) -> None:
    """On the embedded stack, with some things aged 40 days: `gc --older-than 30` lists an orphan checkpoint, an
    ended job's directory and an unused code archive, and not the registered version's checkpoint, a running
    job's directory or anything young; `--apply` frees exactly what it listed."""
    import json
    import os
    import time
    import uuid

    from blocks.home import gpuferry_cache
    from blocks.records import CodeRef, TrainingJob
    from blocks.specs import ServingSpec, TrainingSpec
    from blocks.stack import Stack
    from flows.retrain import retrain

    old = time.time() - 40 * 86400

    def age(path: Path) -> None:
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            os.utime(p, (old, old))

    blocks = Stack.embedded()
    model = f"diabetes-gc-{uuid.uuid4().hex[:6]}"
    retrain(
        workload=str(DIABETES),
        training=TrainingSpec(model_name=model),
        serving=ServingSpec(service_name=model),
        force_deploy=True,
    )
    blocks.serving.undeploy(model)
    kept_uri = blocks.tracking.model_source(model, "1")
    kept = Path(kept_uri.removeprefix("file://"))
    age(kept)
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "weights.bin").write_bytes(b"x" * 4096)
    orphan = blocks.storage.put(tmp_path / "orphan", f"gc-orphan-{uuid.uuid4().hex[:6]}")
    age(Path(orphan.uri.removeprefix("file://")))

    compute = blocks.compute
    code = CodeRef(root=str(tmp_path), archive=str(tmp_path / "unused.tar.gz"), sha256="0" * 64)
    done = TrainingJob(key=f"gc-done-{uuid.uuid4().hex[:6]}", workdir="", command=["python", "-c", "pass"], code=code)
    done = done.model_copy(update={"workdir": compute.job_workdir(done.key)})
    assert compute.watch(compute.submit(done), timeout_seconds=120).state == "COMPLETED"
    age(Path(done.workdir))
    busy = done.model_copy(update={"key": f"gc-busy-{uuid.uuid4().hex[:6]}", "command": ["sleep", "300"]})
    busy = busy.model_copy(update={"workdir": compute.job_workdir(busy.key)})
    running = compute.submit(busy)
    archive = gpuferry_cache() / "code" / f"{'ab' * 32}.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(b"archive")
    age(archive)
    try:
        age(Path(busy.workdir))
        code, out = run("gc", "--older-than", "30", "--json")
        assert code == 0, out
        listed = {item["where"] for item in json.loads(out[out.index("[") : out.rindex("]") + 1])}
        wanted = {orphan.uri, done.workdir, str(archive)}
        assert wanted <= listed, listed
        assert not {kept_uri, busy.workdir} & listed, listed
        assert "would free" in out and "--apply" in out
        assert all(Path(p.removeprefix("file://")).exists() for p in wanted)  # a dry run touches nothing

        code, out = run("gc", "--older-than", "30", "--apply")
        assert code == 0 and "freed" in out, out
        assert not any(Path(p.removeprefix("file://")).exists() for p in wanted)
        assert (kept / "MANIFEST.json").exists() and Path(busy.workdir).exists()
        assert blocks.storage.read_manifest(kept_uri)["files"]
    finally:
        compute.cancel(running)


def test_cancel_stops_the_training_job_and_the_run(tmp_path: Path) -> None:
    """A retrain in a process of its own (as `gpuferry run --local` starts one) whose job would run ten minutes:
    `cancel` stops the job on the stack it runs on and ends the run Cancelled; its process then ends."""
    import json
    import time
    import uuid

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL

    from blocks.records import JobHandle
    from blocks.stack import Stack
    from tasks.waiting import RUN_JOB_LABEL
    from tests.processes import stop_process_group

    work = tmp_path / "sleeper"
    assert run("init", str(work))[0] == 0
    (work / "train.py").write_text("import time\nprint('training', flush=True)\ntime.sleep(600)\n")
    name = f"cancel-probe-{uuid.uuid4().hex[:6]}"
    script = (
        f"from flows.retrain import retrain\nretrain.with_options(flow_run_name={name!r})(workload={str(work)!r})\n"
    )
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, start_new_session=True)
    try:
        handle = None
        deadline = time.monotonic() + 300
        with get_client(sync_client=True) as client:
            while handle is None:
                assert time.monotonic() < deadline, "the run never labelled its training job"
                assert proc.poll() is None, f"the run ended first: {proc.returncode}"
                found = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
                if found and (found[0].labels or {}).get(RUN_JOB_LABEL):
                    handle = JobHandle.model_validate_json(found[0].labels[RUN_JOB_LABEL])
                time.sleep(1)
            compute = Stack.embedded().compute
            assert compute.poll([handle])[handle.job_id].state == "RUNNING"
            code, out = run("runs", "--json", "-n", "20")
            listed = next(r for r in json.loads(out) if r["name"] == name)
            assert listed["job_state"].startswith("RUNNING") and listed["job"].endswith(handle.job_id), listed

            code, out = run("cancel", name)
            assert code == 0 and f"cancelled its training job {handle.job_id}" in out, out
            deadline = time.monotonic() + 120
            while (state := compute.poll([handle])[handle.job_id].state) != "CANCELLED":
                assert time.monotonic() < deadline, f"the job is still {state}"
                time.sleep(1)
            assert proc.wait(timeout=180) != 0  # the flow's process ends (aborted: the run is Cancelled)
            (ended,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            assert ended.state is not None and ended.state.name == "Cancelled", ended.state
        code, out = run("cancel", name)
        assert code == 0 and "already ended: Cancelled" in out, out
    finally:
        stop_process_group(proc)
