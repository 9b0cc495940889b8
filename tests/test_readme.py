"""README "Run it on your own cluster", run as written: its commands and its stack file, on the local stacks.

The commands are taken from the README's code block and run one by one with bash; the stack file is the
README's YAML block. Only the example's site values are replaced, each by a literal that must be in the
README (so a changed README fails here instead of silently skipping a replacement): hosts, ports, paths,
user, partition and account, the bucket, namespace, stack and workload names of this test (unique per run on
the shared servers), and what this machine's Slurm nodes need on top of a site's (SLURM_CONF, podman's own
config files for the plain-HTTP registry, stand-in GPUs as CUDA_VISIBLE_DEVICES). The pods reach the
loopback-only S3 stack through a relay inside the k8s node (``s3_for_pods`` in conftest.py; the serving block's
``env`` gives them its address over the one in the store's Secret the deploy makes), and the node
pulls with the namespace's image pull secret (``k8s_namespace``). The first line installs gpuferry as the
README says, from this repository's committed HEAD (``git+file://REPO@<commit>`` for the README's URL), into
a tool directory of the test's own (UV_TOOL_DIR, UV_TOOL_BIN_DIR), with the lock's versions (UV_CONSTRAINT);
the commands after it run that installed ``gpuferry`` (no other is on PATH) in a directory of their own, not
in this checkout. The run without --local goes through a worker of this checkout on a work pool of the
test's own (GPUFERRY_WORK_POOL), as the shared pool's worker runs another checkout.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from blocks.storage.s3 import S3CheckpointStore
from tests import private_worker
from tests.k8s_node import ready_pods
from tests.stacks import mlflow_server, remote_slurm, remove_on_cluster, stack_env

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Run it on your own cluster"


def readme_blocks() -> tuple[list[str], str]:
    """The section's commands (one per line of its sh block) and its stack file (its yaml block)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    sh = re.search(r"```sh\n(.*?)```", section, re.S)
    stack_file = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert sh and stack_file, "the section has lost its sh or yaml block"
    return [line for line in sh.group(1).splitlines() if line.strip()], stack_file.group(1)


def substitute(text: str, values: list[tuple[str, str]]) -> str:
    for old, new in values:
        assert old in text, f"the README no longer has {old!r}: update this test's replacements with it"
        text = text.replace(old, new)
    return text


@pytest.fixture
def world(
    tmp_path: Path, k8s_namespace: str, s3_store: S3CheckpointStore, s3_for_pods: dict[str, str]
) -> Iterator[dict[str, Any]]:
    uid = uuid.uuid4().hex[:8]
    slurm, registry, s3, mlflow, k8s, prefect = (
        stack_env(n) for n in ("slurm", "registry", "s3", "mlflow", "k8s", "prefect")
    )
    cluster = remote_slurm("readme")  # its jobs' directory: on the cluster's own filesystem, not this machine's
    workdir = cluster.workdir_root
    stack, workload = f"readme-{uid}", f"house-prices-{uid}"
    local_slurm = "\n".join(
        [
            f"host: {slurm['SLURM_SSH_HOST']}",
            f"      port: {slurm['SLURM_SSH_PORT']}",
            f"      slurm_conf: {slurm['SLURM_CONF']}",
            "      podman_gpu_mode: env",
            "      container_runtime_env: "
            + yaml.safe_dump(
                {k: registry[k] for k in ("CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF")},
                default_flow_style=True,
            ).strip(),
        ]
    )
    file_values = [
        ("unix:///run/podman/podman.sock", registry["DOCKER_HOST"]),
        ("registry.example.org/mirror/python:3.11-slim", registry["BASE_IMAGE"]),
        ("registry_url: registry.example.org", f"registry_url: 'http://{registry['REGISTRY_URL']}'"),
        ("username: ci", f"username: {registry['REGISTRY_USER']}"),
        ("repository: team/house-prices", "repository: gpuferry-test/readme"),
        ("host: login.hpc.example.org", local_slurm),
        ("user: alice", f"user: {slurm['SLURM_SSH_USER']}"),
        ("~/.ssh/id_ed25519", slurm["SLURM_SSH_KEY"]),
        ("~/.ssh/known_hosts", slurm["SLURM_KNOWN_HOSTS"]),
        ("partition: gpu", f"partition: {slurm['SLURM_PARTITION']}"),
        ("account: ml-team", f"account: {slurm['SLURM_ACCOUNT']}"),
        ("/shared/gpuferry", str(workdir)),
        ("bucket_name: models", f"bucket_name: {s3_store.bucket.bucket_name}"),
        ("region_name: us-east-1", f"region_name: {s3['AWS_DEFAULT_REGION']}"),
        ("https://s3.example.org", s3["S3_ENDPOINT_URL"]),
        ("https://mlflow.example.org", mlflow["MLFLOW_TRACKING_URI"]),
        ("username: alice", f"username: {mlflow['MLFLOW_TRACKING_USERNAME']}"),
        ("~/.kube/config", k8s["KUBECONFIG"]),
        (
            "namespace: models",
            f"namespace: {k8s_namespace}\n      env: {{AWS_ENDPOINT_URL: '{s3_for_pods['AWS_ENDPOINT_URL']}'}}",
        ),
        ("cluster_name: hpc", f"cluster_name: {stack}"),
        ("  hpc:", f"  {stack}:"),
    ]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    command_values = [
        ("git+<this repository>", f"git+file://{REPO}@{head}"),
        ("house-prices", workload),
        # A busy CI machine may take longer than the 10 s default to answer a check; the rows are what is tested.
        ("check hpc ", f"check {stack} --timeout 60 "),
        ("--stack hpc", f"--stack {stack}"),
    ]
    pool = f"gpuferry-readme-{uid}"
    # The installed gpuferry is the only one on PATH; uv is the one `make venv` installed, on a PATH of its own.
    (tmp_path / "uv-bin").mkdir()
    (tmp_path / "uv-bin" / "uv").symlink_to(shutil.which("uv") or REPO / ".venv/bin/uv")
    path = [str(tmp_path / "bin"), str(tmp_path / "uv-bin")] + [
        p for p in os.environ["PATH"].split(os.pathsep) if p and not (Path(p) / "gpuferry").exists()
    ]
    env = {
        **os.environ,
        "PATH": os.pathsep.join(path),
        "UV_TOOL_DIR": str(tmp_path / "tools"),
        "UV_TOOL_BIN_DIR": str(tmp_path / "bin"),
        "UV_CONSTRAINT": str(REPO / "requirements.lock"),
        "KUBECONFIG": k8s["KUBECONFIG"],
        "PREFECT_API_URL": prefect["PREFECT_API_URL"],
        "PREFECT_UI_URL": prefect["PREFECT_UI_URL"],
        "GPUFERRY_WORK_POOL": pool,
        "GPUFERRY_HOME": str(tmp_path / "home"),
        "COLUMNS": "240",  # the tables of `services` and `runs` unwrapped
        "REGISTRY_PASSWORD": Path(registry["REGISTRY_PASSWORD_FILE"]).read_text().strip(),
        "AWS_ACCESS_KEY_ID": s3["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": s3["AWS_SECRET_ACCESS_KEY"],
        "MLFLOW_TRACKING_PASSWORD": mlflow["MLFLOW_TRACKING_PASSWORD"],
    }
    env.pop("PREFECT_HOME", None)
    workers: list[subprocess.Popen[bytes]] = []

    def start_worker() -> None:
        """`gpuferry worker` of the installed tool, as a team runs it: no clone, no GPUFERRY_CODE_DIR, started
        outside the checkout with nothing of it on the path (started once the README installed it)."""
        worker_env = {**private_worker.worker_env(prefect["PREFECT_API_URL"], tmp_path / "worker-home")}
        for name in ("GPUFERRY_CODE_DIR", "PYTHONPATH", "VIRTUAL_ENV"):
            worker_env.pop(name, None)
        worker_env["PATH"] = env["PATH"]
        name = f"readme-{uid}"
        argv = [str(tmp_path / "bin" / "gpuferry"), "worker", "--pool", pool, "--name", name]
        (tmp_path / "worker-cwd").mkdir()
        workers.append(
            private_worker.start_worker(
                pool, name, worker_env, tmp_path / "worker.log", argv=argv, cwd=tmp_path / "worker-cwd"
            )
        )

    try:
        yield {
            "tmp": tmp_path,
            "env": env,
            "head": head,
            "file_values": file_values,
            "command_values": command_values,
            "stack": stack,
            "workload": workload,
            "namespace": k8s_namespace,
            "mlflow": mlflow_server(),
            "kubeconfig": k8s["KUBECONFIG"],
            "start_worker": start_worker,
        }
    finally:
        for worker in workers:
            private_worker.stop(worker)
        if (tmp_path / "worker.log").exists():
            print((tmp_path / "worker.log").read_text()[-5000:])
        private_worker.remove(prefect["PREFECT_API_URL"], [f"retrain/{workload}", f"sweep/{workload}"], pool)
        _forget(prefect["PREFECT_API_URL"], stack, mlflow_server(), workload)
        remove_on_cluster(cluster, workdir)
        cluster.close()


def _forget(api_url: str, stack: str, tracking: Any, model: str) -> None:
    """The shared servers keep nothing of this test: its Stack block and its registered model (``tracking``: the
    mlflow stack's block, with its login)."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        try:
            doc = client.read_block_document_by_name(stack, block_type_slug="gpuferry-stack")
            client.delete_block_document(doc.id)
        except Exception as exc:  # noqa: BLE001 - best effort; the test's own failure is what matters - best effort
            print(f"cleanup: stack {stack}: {exc}")
    try:
        tracking.client.delete_registered_model(model)
    except Exception as exc:  # noqa: BLE001
        print(f"cleanup: model {model}: {exc}")


def test_the_readme_commands_serve_a_model_on_slurm_s3_mlflow_and_kubernetes(world: dict[str, Any]) -> None:
    commands, stack_file = readme_blocks()
    assert commands[0].startswith("uv tool install ")
    repository = world["tmp"] / "repository"  # the user's own repository: not gpuferry's checkout
    repository.mkdir()
    (repository / "stack.yaml").write_text(substitute(stack_file, world["file_values"]))
    for old, _ in world["command_values"]:
        assert any(old in c for c in commands), f"the README's commands no longer have {old!r}: update this test"
    outputs = []
    began = time.monotonic()
    for command in commands:
        line = command
        for old, new in world["command_values"]:
            line = line.replace(old, new)
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", line], cwd=repository, env=world["env"], capture_output=True, text=True, timeout=1800
        )
        out = done.stdout + done.stderr
        print(f"$ {line}  ({time.monotonic() - started:.1f} s)\n{out[-4000:]}")
        assert done.returncode == 0, f"{line}\n{out[-6000:]}"
        outputs.append(out)
        if len(outputs) == 1:  # installed: the team's worker starts from it
            world["start_worker"]()
    print(f"the README's commands: {time.monotonic() - began:.0f} s")
    assert not any("kubectl" in c for c in commands)  # the deploy gives the pods the store's keys itself
    install, init, apply, check, local, deployed, services, runs = outputs
    # The commands ran the gpuferry installed from the committed HEAD, not this checkout's.
    assert "Installed 1 executable: gpuferry" in install
    assert shutil.which("gpuferry", path=world["env"]["PATH"]) == str(world["tmp"] / "bin" / "gpuferry")
    direct_url = next((world["tmp"] / "tools" / "gpuferry").glob("lib/python*/site-packages/gpuferry-*.dist-info"))
    assert json.loads((direct_url / "direct_url.json").read_text())["vcs_info"]["commit_id"] == world["head"]
    stack, model, ns = world["stack"], world["workload"], world["namespace"]
    assert "wrote " in init and (repository / model / "gpuferry.yaml").is_file()
    assert f"{stack}: created" in apply
    assert "all checks passed" in check
    assert f"model version: {model} v1 (val_rmse=" in local and "promoted" in local
    assert f"endpoint: http://{model}.{ns}.svc.cluster.local:80" in local
    assert f"registered retrain/{model}, sweep/{model}" in deployed  # the first run through a deployment
    assert "promoted: yes" in deployed and f"endpoint: http://{model}.{ns}.svc.cluster.local:80" in deployed
    assert re.search(r": Completed — http://\S+/runs/flow-run/", deployed)
    assert re.search(rf"{model}\s.*{model}\s.*\b2\s.*http://{model}\.{ns}\.svc\.cluster\.local", services), services
    assert re.search(rf"retrain\s.*Completed\s.*{stack}\s.*{model} v2 val_rmse=", runs), runs

    # Version 2 serves on Kubernetes: its pod loaded the checkpoint from S3 and answers the model's input example.
    from pydantic import SecretStr

    from blocks.kubernetes import manifests as m
    from blocks.kubernetes.cluster import KubernetesCluster
    from blocks.specs import ServingSpec

    client = world["mlflow"].client
    v1_run = client.get_run(client.get_model_version(model, "1").run_id)
    assert v1_run.data.tags["gpuferry.git_sha"] == world["head"]  # trained by the installed commit
    assert client.get_model_version_by_alias(model, "champion").version == "2"
    block = KubernetesCluster(kubeconfig=SecretStr(Path(world["kubeconfig"]).read_text()), namespace=ns)
    dep = block._api().get(f"/apis/apps/v1/namespaces/{ns}/deployments/{model}")
    assert dep["metadata"]["annotations"][m.MODEL_VERSION_ANNOTATION] == "2"
    (pod,) = ready_pods(block, model)
    status, ready = block.pod_request(pod["metadata"]["name"], "/readyz")
    assert status == 200
    assert ready["model"]["checkpoint_sha256"] == client.get_model_version(model, "2").tags["checkpoint_sha256"]
    columns = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]
    status, answer = block.pod_request(
        pod["metadata"]["name"], "/invocations", {"dataframe_split": {"columns": columns, "data": [[0.0] * 10]}}
    )
    assert status == 200 and len(answer["predictions"]) == 1
    # The store's keys reached the pod through the Secret the deploy made, and only through it.
    secret_path = f"/api/v1/namespaces/{ns}/secrets/{m.store_secret_name(ServingSpec(service_name=model))}"
    secret = block._api().get(secret_path)
    key = world["env"]["AWS_SECRET_ACCESS_KEY"]
    assert base64.b64decode(secret["data"]["AWS_SECRET_ACCESS_KEY"]).decode() == key
    assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert key not in json.dumps(dep) and key not in json.dumps(pod)
    block.undeploy(model)
    assert block._api().get_or_none(secret_path) is None
