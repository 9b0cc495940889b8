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
        import playwright.sync_api  # noqa: F401 - only whether it imports
    except ImportError:
        _missing("playwright is not installed in this environment (the test extra of pyproject.toml)")
    deploy = subprocess.run(
        [str(REPO / ".venv/bin/prefect"), "--no-prompt", "deploy", "--name", "weekly"],
        cwd=REPO,
        env={**_env_without_home(), "PREFECT_API_URL": env["PREFECT_API_URL"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    forms = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "deployments.forms", "--deployment", DEPLOYMENT],
        cwd=REPO,
        env={**_env_without_home(), "PREFECT_API_URL": env["PREFECT_API_URL"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert forms.returncode == 0, forms.stdout[-3000:] + forms.stderr[-3000:]
    return env


def _env_without_home() -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_HOME", None)
    return env


@pytest.fixture
def page(prefect: dict[str, str]) -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    # The page's actions and the `expect` assertions (5 s by default) alike wait as long as a busy shared server
    # may take to answer: creating a run, or refusing one, can take longer than 5 s there.
    expect.set_options(timeout=UI_TIMEOUT_MS)
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


SERVICES = ("digits", "diabetes")  # the examples' services, as their gpuferry.yaml names them


@pytest.fixture
def worker_serving(prefect: dict[str, str]) -> Iterator[None]:
    """A run that gets promoted starts an inference server in the worker's home: stop the ones this test started."""
    from blocks.local.serving import LocalServing

    serving = LocalServing(state_dir=str(Path(prefect["GPUFERRY_WORKER_HOME"]) / "serving"), drain_seconds=5)
    before = {name: serving.current(name) for name in SERVICES}
    yield
    for name in SERVICES:
        after = serving.current(name)
        if after is not None and (before[name] is None or after["pid"] != before[name]["pid"]):
            serving.undeploy(name)


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
    assert run.parameters["workload"] == "examples/digits"


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


# ---- each workload's own form ----------------------------------------------------------------------


def form_property(page: Any, name: str) -> Any:
    """The form's field called ``name`` (its innermost property box)."""
    label = page.locator(".schema-form-property__label", has_text=re.compile(rf"^{re.escape(name)}( \(Optional\))?$"))
    return label.first.locator(
        "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]"
    )


def open_custom_run(page: Any, ui: str, flow: str, deployment: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    page.goto(f"{ui}/deployments")
    page.get_by_placeholder("Search deployments").fill(deployment)
    # The search reaches the URL after a debounce and re-renders the list: a click before that can be lost.
    page.wait_for_url(re.compile(r"flowOrDeploymentNameLike="))
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name=flow, exact=True))
    link = row.get_by_role("link", name=deployment, exact=True)
    detail = re.compile(r"/deployments/deployment/[0-9a-f-]{36}$")
    for attempt in range(6):  # a click the list's re-render swallowed is clicked again
        expect(link).to_be_visible()
        link.click()
        try:
            page.wait_for_url(detail, timeout=15_000)
            break
        except PlaywrightTimeout:
            if attempt == 5:
                raise
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    page.wait_for_url(re.compile(r"/deployments/deployment/[0-9a-f-]{36}/run"))
    expect(page.locator(".schema-form-property__label", has_text="Hyperparameters of")).to_be_visible()


def hyperparameter_labels(page: Any) -> list[str]:
    box = form_property(
        page,
        page.locator(".schema-form-property__label", has_text="Hyperparameters of")
        .first.inner_text()
        .removesuffix(" (Optional)"),
    )
    labels = box.locator(".schema-form-property .schema-form-property__label").all_inner_texts()
    return [label.removesuffix(" (Optional)") for label in labels]


def submit_and_read_toast(page: Any) -> str:
    from playwright.sync_api import expect

    page.get_by_role("button", name="Submit", exact=True).click()
    toast = page.locator(".toast-flow-run-create").first
    expect(toast).to_contain_text("scheduled")
    return toast.locator(".toast-flow-run-create__message--emphasized").first.inner_text().strip()


def test_each_workload_deployment_has_its_own_form(
    prefect: dict[str, str], page: Any, worker_serving: None, tmp_path: Path
) -> None:
    """After `python -m deployments.forms` the UI shows each workload's hyperparameters (types, enums, defaults,
    in the file's order), the server refuses a value the workload's schema does not allow, and the runs made
    from the forms train what was filled in."""
    from playwright.sync_api import expect
    from prefect.client.orchestration import SyncPrefectClient

    deploy = subprocess.run(
        [str(REPO / ".venv/bin/prefect"), "--no-prompt", "deploy", "--name", "weekly", "--name", "diabetes"],
        cwd=REPO,
        env={**_env_without_home(), "PREFECT_API_URL": prefect["PREFECT_API_URL"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    forms = subprocess.run(
        [
            str(REPO / ".venv/bin/python"),
            "-m",
            "deployments.forms",
            "--deployment",
            "retrain/weekly",
            "--deployment",
            "retrain/diabetes",
        ],
        cwd=REPO,
        env={**_env_without_home(), "PREFECT_API_URL": prefect["PREFECT_API_URL"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert forms.returncode == 0 and "2 deployment(s)" in forms.stdout, forms.stdout + forms.stderr
    ui = prefect["PREFECT_UI_URL"].rstrip("/")
    with screenshot_on_failure(page, tmp_path):
        # The regressor: its own four fields, in the order of its gpuferry.yaml, with their defaults.
        open_custom_run(page, ui, "retrain", "diabetes")
        assert hyperparameter_labels(page) == ["Alpha", "L1 Ratio", "Max Iter", "Standardize"]
        assert form_property(page, "Alpha").locator("input").input_value() == "0.1"
        expect(form_property(page, "Standardize").get_by_role("switch")).to_have_attribute("aria-checked", "true")
        assert "Lr" not in page.locator(".schema-form-property__label").all_inner_texts()  # not the digits' fields
        form_property(page, "Alpha").locator("input").fill("0.05")
        diabetes_run = submit_and_read_toast(page)

        # The digits MLP: an enum as a choice of its values; a value out of bounds is refused by the server.
        open_custom_run(page, ui, "retrain", "weekly")
        labels = hyperparameter_labels(page)
        assert labels == ["Epochs", "Lr", "Batch Size", "Hidden", "Dropout", "Seed", "Optimizer"], labels
        optimizer = form_property(page, "Optimizer")
        optimizer.locator("button.p-select-button__control").focus()
        page.keyboard.press("Space")
        expect(page.get_by_role("option")).to_have_text(["sgd", "adam"])
        page.get_by_role("option", name="adam", exact=True).click()
        expect(optimizer.locator(".p-select-button__value")).to_have_text("adam")
        form_property(page, "Epochs").locator("input").fill("2")
        form_property(page, "Lr").locator("input").fill("-1")
        page.get_by_role("button", name="Submit", exact=True).click()
        refused = page.get_by_text(
            re.compile(
                r"Validation failed for field 'training\.hyperparameters\.lr'\. "
                r"Failure reason: -1 is less than or equal to the minimum of 0"
            )
        )
        expect(refused.first).to_be_visible()
        form_property(page, "Lr").locator("input").fill("0.1")
        digits_run = submit_and_read_toast(page)

    with SyncPrefectClient(prefect["PREFECT_API_URL"]) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

        runs = {
            r.name: r
            for r in client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[diabetes_run, digits_run]))
            )
        }
        schema = client.read_deployment_by_name("retrain/weekly").parameter_openapi_schema
    assert runs[diabetes_run].parameters["workload"] == "examples/diabetes"
    assert runs[diabetes_run].parameters["training"]["hyperparameters"] == {
        "alpha": 0.05,
        "l1_ratio": 0.5,
        "max_iter": 10000,
        "standardize": True,
    }
    digits = runs[digits_run].parameters["training"]["hyperparameters"]
    assert (digits["optimizer"], digits["epochs"], digits["lr"]) == ("adam", 2, 0.1)
    assert schema["properties"]["workload"]["enum"] == ["examples/digits"]
    # Only the one run with good values was created for the digits deployment's form (the refused one was not).
    with SyncPrefectClient(prefect["PREFECT_API_URL"]) as client:
        from prefect.client.schemas.filters import FlowRunFilterDeploymentId

        deployment = client.read_deployment_by_name("retrain/weekly")
        recent = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id])), limit=200
        )
    refused_runs = [
        r for r in recent if (r.parameters.get("training") or {}).get("hyperparameters", {}).get("lr") == -1
    ]
    assert refused_runs == []

    def final() -> bool:
        with SyncPrefectClient(prefect["PREFECT_API_URL"]) as client:
            return all(client.read_flow_run(runs[name].id).state.is_final() for name in (diabetes_run, digits_run))

    deadline = time.monotonic() + RUN_DEADLINE_S
    while not final():
        assert time.monotonic() < deadline, f"the runs {diabetes_run}, {digits_run} did not finish in time"
        time.sleep(2)
    with SyncPrefectClient(prefect["PREFECT_API_URL"]) as client:
        states = {name: client.read_flow_run(runs[name].id).state.name for name in (diabetes_run, digits_run)}
    assert states == {diabetes_run: "Completed", digits_run: "Completed"}, states


# ---- the stack, picked from the saved ones ---------------------------------------------------------------


def test_the_stack_is_picked_from_the_saved_stacks(prefect: dict[str, str], page: Any, tmp_path: Path) -> None:
    """The run form's `stack` offers the saved Stack blocks; the run made with the one picked trains with it."""
    import uuid

    from mlflow import MlflowClient
    from playwright.sync_api import expect
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.filesystems import LocalFileSystem
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks.local.compute import LocalProcesses
    from blocks.local.images import CurrentEnvironment
    from blocks.local.provider import LocalMachine
    from blocks.local.serving import LocalServing
    from blocks.local.storage import LocalCheckpointStore
    from blocks.stack import Stack
    from blocks.tracking.mlflow import MlflowTracking
    from deployments import skeleton
    from tests import private_worker

    api, uid = prefect["PREFECT_API_URL"], uuid.uuid4().hex[:8]
    name, pool = f"ui-pick-{uid}", f"gpuferry-ui-pick-{uid}"
    workload = tmp_path / name
    skeleton.write(workload)
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    serving = LocalServing(state_dir=str(tmp_path / "serving"), drain_seconds=5)
    picked = Stack(
        provider=LocalMachine(),
        images=CurrentEnvironment(),
        compute=LocalProcesses(workdir_root=str(tmp_path / "jobs")),
        storage=LocalCheckpointStore(filesystem=LocalFileSystem(basepath=str(tmp_path / "storage"))),
        tracking=MlflowTracking(tracking_uri=tracking_uri),
        serving=serving,
    )
    with temporary_settings({PREFECT_API_URL: api}):
        block_id = picked.save(name, _sync=True)  # a sync call: playwright runs an event loop in this thread
    env = {**_env_without_home(), "PREFECT_API_URL": api, "GPUFERRY_WORK_POOL": pool}
    worker = None
    try:
        deploy = subprocess.run(
            [str(REPO / ".venv/bin/gpuferry"), "deploy", "--workload", str(workload)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        worker = private_worker.start_worker(
            pool, name, private_worker.worker_env(api, tmp_path / "worker-home"), tmp_path / "worker.log"
        )
        with screenshot_on_failure(page, tmp_path):
            open_custom_run(page, prefect["PREFECT_UI_URL"].rstrip("/"), "retrain", name)
            stack = form_property(page, "stack")
            stack.get_by_role("button", name="Stack", exact=True).click()
            stack.locator(".block-documents-select button.p-select-button__control").focus()
            page.keyboard.press("Space")
            expect(page.get_by_role("option", name=name, exact=True)).to_be_visible()  # among the saved stacks
            page.get_by_role("option", name=name, exact=True).click()
            expect(stack.locator(".p-select-button__value")).to_have_text(name)
            run_name = submit_and_read_toast(page)
        with SyncPrefectClient(api) as client:
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

            (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])))
        assert run.parameters["stack"] == {"$ref": {"block_document_id": str(block_id)}}
        deadline = time.monotonic() + RUN_DEADLINE_S
        while True:
            with SyncPrefectClient(api) as client:
                state = client.read_flow_run(run.id).state
            if state is not None and state.is_final():
                break
            assert time.monotonic() < deadline, f"{run_name} did not finish in time"
            time.sleep(2)
        assert state.is_completed(), f"{run_name}: {state.name} {state.message}"
        # It ran on the stack picked: its MLflow store is that stack's.
        assert str(MlflowClient(tracking_uri).get_model_version_by_alias(name, "champion").version) == "1"
    finally:
        serving.undeploy(name)
        private_worker.stop(worker)
        private_worker.remove(api, [f"retrain/{name}", f"sweep/{name}"], pool)
        with SyncPrefectClient(api) as client:
            client.delete_block_document(block_id)


# ---- a workload with nested hyperparameters --------------------------------------------------------------

NESTED_WORKLOAD = REPO / "tests" / "workloads" / "nested"  # objects two levels deep, enums in them, an array


def gpuferry(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``gpuferry ARGS`` of this checkout (the console script in .venv/bin imports the code it was installed from)."""
    main = "import sys; from deployments.cli import main; sys.argv[0] = 'gpuferry'; main()"
    return subprocess.run(
        [str(REPO / ".venv/bin/python"), "-c", main, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def select_option(page: Any, field: Any, option: str) -> None:
    from playwright.sync_api import expect

    field.locator("button.p-select-button__control").first.focus()
    page.keyboard.press("Space")
    page.get_by_role("option", name=option, exact=True).click()
    expect(field.locator(".p-select-button__value").first).to_have_text(option)


def test_nested_hyperparameters_are_fields_of_their_own(prefect: dict[str, str], page: Any, tmp_path: Path) -> None:
    """A workload whose hyperparameters nest objects (an enum inside, an object inside that) and an array, deployed
    with `gpuferry deploy --workload`: the form shows every nested field in the file's order with its default, the
    server refuses a bad nested value naming its field (and an unknown nested key naming the valid ones), and the
    run made from the form carries the nested values filled in."""
    import shutil
    import uuid

    from playwright.sync_api import expect
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterName

    api, uid = prefect["PREFECT_API_URL"], uuid.uuid4().hex[:8]
    name, pool = f"nested-form-{uid}", f"gpuferry-ui-nested-{uid}"  # a pool no worker serves: the runs stay put
    workload = tmp_path / name
    shutil.copytree(NESTED_WORKLOAD, workload)
    definition = workload / "gpuferry.yaml"
    definition.write_text(definition.read_text().replace("\nname: nested-form\n", f"\nname: {name}\n"))
    env = {**_env_without_home(), "PREFECT_API_URL": api, "GPUFERRY_WORK_POOL": pool}
    try:
        deploy = gpuferry("deploy", "--workload", str(workload), env=env)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        with screenshot_on_failure(page, tmp_path):
            open_custom_run(page, prefect["PREFECT_UI_URL"].rstrip("/"), "retrain", name)
            assert hyperparameter_labels(page) == [
                "Epochs",
                "Optimizer",
                "Kind",
                "Lr",
                "Schedule",
                "Warmup Steps",
                "Decay",
                "Layers",
            ]
            optimizer, schedule = form_property(page, "Optimizer"), form_property(page, "Schedule")
            expect(form_property(page, "Kind").locator(".p-select-button__value")).to_have_text("sgd")
            assert form_property(page, "Lr").locator("input").input_value() == "0.01"
            assert form_property(page, "Warmup Steps").locator("input").input_value() == "100"
            expect(form_property(page, "Decay").locator(".p-select-button__value")).to_have_text("cosine")
            layers = form_property(page, "Layers").locator(".schema-form-property-array-item input")
            assert [layers.nth(i).input_value() for i in range(layers.count())] == ["64", "32"]
            assert optimizer.locator(".schema-form-property__label", has_text="Warmup Steps").count() == 1  # nested
            assert schedule.locator(".schema-form-property__label", has_text="Lr").count() == 0

            select_option(page, form_property(page, "Kind"), "adam")
            form_property(page, "Lr").locator("input").fill("0.2")
            select_option(page, form_property(page, "Decay"), "linear")
            layers.nth(1).fill("16")
            form_property(page, "Layers").get_by_role("button", name="Add item").click()
            expect(layers).to_have_count(3)
            layers.nth(2).fill("8")
            form_property(page, "Warmup Steps").locator("input").fill("-5")  # below its minimum of 0
            page.get_by_role("button", name="Submit", exact=True).click()
            refused = page.get_by_text(
                re.compile(
                    r"Validation failed for field 'training\.hyperparameters\.optimizer\.schedule\.warmup_steps'\. "
                    r"Failure reason: -5 is less than the minimum of 0"
                )
            )
            expect(refused.first).to_be_visible()
            form_property(page, "Warmup Steps").locator("input").fill("10")
            page.keyboard.press("Tab")  # leave the field, as a person does before they click Submit
            run_name = submit_and_read_toast(page)

        with SyncPrefectClient(api) as client:
            (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])))
            deployment = client.read_deployment_by_name(f"retrain/{name}")
            # An unknown nested key (no form makes one; an API call can) is refused too, naming the valid keys.
            from prefect.exceptions import PrefectHTTPStatusError

            typo = {
                "workload": str(workload),
                "training": {"hyperparameters": {"optimizer": {"schedule": {"warmpu": 3}}}},
            }
            with pytest.raises(PrefectHTTPStatusError) as info:
                client.create_flow_run_from_deployment(deployment.id, parameters=typo)
            assert (
                "Validation failed for field 'training.hyperparameters.optimizer.schedule'. Failure reason: 'warmpu' "
                "is not one of ['warmup_steps', 'decay']"
            ) in info.value.response.text
            made = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))
            )
        assert run.deployment_id == deployment.id and [r.id for r in made] == [run.id]  # the refused ones: no run
        assert run.parameters["workload"] == str(workload)
        assert run.parameters["training"]["hyperparameters"] == {
            "epochs": 3,
            "optimizer": {"kind": "adam", "lr": 0.2, "schedule": {"warmup_steps": 10, "decay": "linear"}},
            "layers": [64, 16, 8],
        }
        # What the run's own check makes of them: the values as filled in, nothing added or refused.
        from blocks.workload.source import load_workload

        hyperparameters = run.parameters["training"]["hyperparameters"]
        assert load_workload(str(workload)).definition.schema.validate(hyperparameters) == hyperparameters
    finally:
        with SyncPrefectClient(api) as client:
            try:
                deployment = client.read_deployment_by_name(f"retrain/{name}")
                for leftover in client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))
                ):
                    client.delete_flow_run(leftover.id)
            except Exception as exc:  # noqa: BLE001 - cleanup of the shared server, best effort
                print(f"cleanup: runs of retrain/{name}: {exc}")
        from tests import private_worker

        private_worker.remove(api, [f"retrain/{name}", f"sweep/{name}"], pool)
