"""`gpuferry deploy --workload` against the Prefect stack's server: each workload gets its own deployments,
with its hyperparameters as their form, on the pool asked for (a pool of the test's own: the shared one is
left alone)."""

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

    api = stack_env("prefect")["PREFECT_API_URL"]
    uid = uuid.uuid4().hex[:8]
    name, pool = f"cli-deploy-{uid}", f"gpuferry-cli-{uid}"
    skeleton.write(tmp_path / name)
    env = {**os.environ, "PREFECT_API_URL": api, "GPUFERRY_WORK_POOL": pool}
    env.pop("PREFECT_HOME", None)
    names = [f"retrain/{name}", f"sweep/{name}"]
    try:
        done = subprocess.run(
            [str(REPO / ".venv/bin/gpuferry"), "deploy", "--workload", name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"registered on work pool {pool}: {', '.join(names)}" in done.stdout
        assert f"with their workload's form: {', '.join(names)}" in done.stdout
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
    finally:
        private_worker.remove(api, names, pool)
