"""The Prefect UI in a headless Chromium: find the retrain deployment, start a run, see it complete.

Runs against the server and worker of `make prefect-up` (scripts/prefect.sh, which also installs
Debian's chromium). Playwright drives /usr/bin/chromium: its own browser downloads are not used.
On failure a screenshot and the page's HTML land in the test's tmp_path.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.stacks import stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("GPUFERRY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
DEPLOYMENT = "retrain/weekly"
# A run of the default parameters trains 20 epochs (~30 s alone); a busy 2-core machine is slower.
RUN_DEADLINE_S = 600.0
UI_TIMEOUT_MS = 60_000
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled", "TimedOut")


def _missing(message: str) -> None:
    if os.environ.get("GPUFERRY_REQUIRE_STACKS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def prefect() -> dict[str, str]:
    env = stack_env("prefect")
    if not Path(CHROMIUM).exists():
        _missing(f"{CHROMIUM} missing: `make prefect-up` installs Debian's chromium")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("playwright is not installed in this environment (the test extra of pyproject.toml)")
    deploy = subprocess.run(
        [str(REPO / ".venv/bin/prefect"), "--no-prompt", "deploy", "--name", "weekly"],
        cwd=REPO, env={**_env_without_home(), "PREFECT_API_URL": env["PREFECT_API_URL"]},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    return env


def _env_without_home() -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_HOME", None)
    return env


@pytest.fixture
def page(prefect: dict[str, str]) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


@contextmanager
def screenshot_on_failure(page: Any, where: Path) -> Iterator[None]:
    """Keep what the browser showed when the test failed: a screenshot and the page's HTML."""
    try:
        yield
    except BaseException:
        try:
            page.screenshot(path=str(where / "failure.png"), full_page=True)
            (where / "failure.html").write_text(page.content())
            print(f"the page at the failure ({page.url}): {where / 'failure.png'}, {where / 'failure.html'}")
        except Exception as exc:  # noqa: BLE001 - the test's own failure is what matters
            print(f"no screenshot: {exc}")
        raise


@pytest.fixture
def worker_serving(prefect: dict[str, str]) -> Iterator[None]:
    """A run that gets promoted starts an inference server in the worker's home: stop the one this test started."""
    from blocks.serving import LocalServing

    serving = LocalServing(state_dir=str(Path(prefect["GPUFERRY_WORKER_HOME"]) / "serving"), drain_seconds=5)
    before = serving.current("digits")
    yield
    after = serving.current("digits")
    if after is not None and (before is None or after["pid"] != before["pid"]):
        serving.undeploy("digits")


def state_badge(page: Any) -> str:
    """The text of the flow run page's state badge (its header)."""
    badge = page.locator(".page-heading-flow-run .state-badge").first
    return badge.inner_text().strip() if badge.count() else ""


def test_run_the_retrain_deployment_from_the_ui(
    prefect: dict[str, str], page: Any, worker_serving: None, tmp_path: Path
) -> None:
    with screenshot_on_failure(page, tmp_path):
        run_id, run_name = start_quick_run(page, prefect["PREFECT_UI_URL"].rstrip("/"))
        seen = wait_in_ui_until_final(page, run_name)
    assert seen[-1] == "Completed", f"run {run_name} ended {seen[-1]} (states seen in the UI: {seen})"

    # What the UI showed is what the server holds: the weekly deployment's run, started by hand.
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(prefect["PREFECT_API_URL"]) as client:
        run = client.read_flow_run(run_id)
        deployment = client.read_deployment_by_name(DEPLOYMENT)
    assert run.name == run_name and run.deployment_id == deployment.id
    assert run.state is not None and run.state.is_completed()
    assert run.created_by is None or run.created_by.type != "SCHEDULE"
    assert run.parameters["training"]["model_name"] == "digits-mlp"


def start_quick_run(page: Any, ui: str) -> tuple[str, str]:
    """Deployments → retrain's `weekly` → Run → Quick run → the new run's page; returns the run's id and name."""
    from playwright.sync_api import expect

    page.goto(f"{ui}/deployments")
    page.get_by_placeholder("Search deployments").fill("weekly")
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name="retrain", exact=True))
    row.get_by_role("link", name="weekly", exact=True).click()
    page.wait_for_url(re.compile(r"/deployments/deployment/[0-9a-f-]{36}"))
    expect(page.get_by_text("flows/retrain.py:retrain")).to_be_visible()

    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_role("button", name="Quick run", exact=True).click()
    # The toast names the new run (the app mounts two toast containers: take the first copy).
    toast = page.locator(".toast-flow-run-create").first
    expect(toast).to_contain_text("scheduled")
    run_name = toast.locator(".toast-flow-run-create__message--emphasized").first.inner_text().strip()
    assert run_name
    # The deployment's runs list shows it (it refreshes by itself); open it from there.
    page.get_by_role("link", name=run_name, exact=True).first.click()
    page.wait_for_url(re.compile(r"/runs/flow-run/[0-9a-f-]{36}"))
    expect(page.locator(".page-heading-flow-run")).to_contain_text(run_name)
    return page.url.rstrip("/").rsplit("/", 1)[-1], run_name


def wait_in_ui_until_final(page: Any, run_name: str) -> list[str]:
    """The states the run page's badge showed until a final one (reloading now and then)."""
    started = time.monotonic()
    last_reload = started
    seen: list[str] = []
    while True:
        state = state_badge(page)
        if state and (not seen or seen[-1] != state):
            seen.append(state)
        if state in FINAL_STATES:
            print(f"{run_name}: {' → '.join(seen)} in {time.monotonic() - started:.1f} s")
            return seen
        assert time.monotonic() - started < RUN_DEADLINE_S, (
            f"run {run_name} did not finish within {RUN_DEADLINE_S:.0f} s in the UI; states seen: {seen}"
        )
        page.wait_for_timeout(2_000)
        # The page follows the run by itself; a reload now and then covers live updates stalling on a busy machine.
        if time.monotonic() - last_reload > 30:
            page.reload()
            last_reload = time.monotonic()
