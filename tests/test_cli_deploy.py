"""`gpuferry deploy --workload` against the Prefect stack's server: each workload gets its own deployments,
with its hyperparameters as their form, on the pool asked for (a pool of the test's own: the shared one is
left alone), its retrain on the schedule asked for; the deployments no workload owns (on-champion, provision,
release) are registered where the server lacks them, and left as they are where it has them."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from deployments import skeleton
from tests import private_worker
from tests.stacks import stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


def test_deploy_registers_the_workloads_own_deployments_with_its_form(tmp_path: Path) -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import ObjectNotFound

    api = stack_env("prefect")["PREFECT_API_URL"]
    uid = uuid.uuid4().hex[:8]
    name, pool = f"cli-deploy-{uid}", f"gpuferry-cli-{uid}"
    skeleton.write(tmp_path / name)
    env = {**os.environ, "PREFECT_API_URL": api, "GPUFERRY_WORK_POOL": pool}
    env.pop("PREFECT_HOME", None)
    names = [f"retrain/{name}", f"sweep/{name}"]
    shared = ["provision/provision", "release/release", "deploy-model/on-champion"]  # prefect.yaml's order

    def exists(client: SyncPrefectClient, full: str) -> bool:
        try:
            client.read_deployment_by_name(full)
        except ObjectNotFound:
            return False
        return True

    with SyncPrefectClient(api) as client:
        had = [full for full in shared if exists(client, full)]
    made: list[str] = []
    try:
        done = subprocess.run(
            [str(REPO / ".venv/bin/gpuferry"), "deploy", "--workload", name, "--cron", "15 4 * * 2"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        made = [full for full in shared if full not in had]
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"registered on work pool {pool}: {', '.join(names + made)}" in done.stdout, done.stdout
        assert f"with their workload's form: {', '.join(names)}" in done.stdout
        assert f"retrain/{name} runs on schedule '15 4 * * 2' (UTC)" in done.stdout
        if had:
            assert f"already on the server, left as they are: {', '.join(had)}" in done.stdout
        with SyncPrefectClient(api) as client:
            for full in names:
                deployment = client.read_deployment_by_name(full)
                assert deployment.work_pool_name == pool
                assert deployment.parameters["workload"] == str((tmp_path / name).resolve())
                schema = deployment.parameter_openapi_schema
                assert schema["properties"]["workload"]["enum"] == [str((tmp_path / name).resolve())]
                hyper = schema["definitions"]["TrainingSpec"]["properties"]["hyperparameters"]
                assert sorted(hyper["properties"]) == ["alpha", "test_fraction"]
                assert deployment.enforce_parameter_schema
                assert {"$ref": "#/definitions/Stack"} in schema["properties"]["stack"]["anyOf"]
            (schedule,) = client.read_deployment_by_name(names[0]).schedules
            assert (schedule.schedule.cron, schedule.schedule.timezone) == ("15 4 * * 2", "UTC")
            assert not client.read_deployment_by_name(names[1]).schedules
            for full in made:  # registered here, on this pool; those the server had are not moved to it
                assert client.read_deployment_by_name(full).work_pool_name == pool
            for full in had:
                assert client.read_deployment_by_name(full).work_pool_name != pool
    finally:
        private_worker.remove(api, names + made, pool)
