"""The `gpuferry` command on the embedded stack: `init` writes a workload that passes `check` and runs.

Runs the command's own code in this process (typer's runner) against the session's Prefect test server.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deployments import skeleton
from deployments.cli import app

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("prefect_server")]
REPO = Path(__file__).resolve().parent.parent


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_init_writes_a_workload_that_passes_check_and_runs(tmp_path: Path) -> None:
    from blocks.serving import LocalServing

    workload = tmp_path / "house-prices"
    code, out = run("init", str(workload))
    assert code == 0 and sorted(p.name for p in workload.iterdir()) == [
        ".dockerignore", "Dockerfile", "gpuferry.yaml", "requirements.txt", "train.py"]  # fmt: skip
    code, out = run("check", "--workload", str(workload), "--no-prefect")
    assert code == 0, out
    assert re.search(r"workload\s.*run plan\s.*ok", out) and "all checks passed" in out

    # The run as a user starts it: the installed command, in a process of its own, on the test's server.
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run([str(REPO / ".venv/bin/gpuferry"), "run", "retrain", "--workload", str(workload), "--local",
                           "--hp", "alpha=0.5"], env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "model version: house-prices v1 (val_rmse=" in out and "promoted" in out
    url = re.search(r"endpoint: (http://\S+)", out)
    assert url is not None, out
    try:
        example = {"dataframe_split": {"columns": ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"],
                                       "data": [[0.0] * 10]}}  # fmt: skip
        answer = httpx.post(f"{url.group(1)}/invocations", json=example, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 1
        # Serving the champion again changes nothing: the same server answers at the same address.
        again = subprocess.run([str(REPO / ".venv/bin/gpuferry"), "run", "deploy", "--model", "house-prices",
                                "--local"], env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
        assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
        assert f"endpoint: {url.group(1)}" in again.stdout
    finally:
        LocalServing().undeploy("house-prices")


def test_init_keeps_what_exists_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("# mine\n")
    written = skeleton.write(tmp_path, name="mine")
    assert sorted(p.name for p in written) == [".dockerignore", "Dockerfile", "gpuferry.yaml", "requirements.txt"]
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


def test_deploy_without_a_workload_outside_a_clone_says_to_name_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments import cli_run

    monkeypatch.setattr(cli_run, "REPO", tmp_path)  # an installed gpuferry: site-packages, no examples/
    code, out = run("deploy")
    assert code == 2 and "run it in a clone, or name your workload with --workload DIR" in out
