"""Stack files: read with errors naming the file, line, field and the valid choices; applied idempotently.

The apply tests save real blocks on the session's Prefect test server, through the `gpuferry` command's own
code (typer's runner, in this process).
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blocks.errors import ConfigurationError
from blocks.slurm.cluster import SlurmCluster
from blocks.stack import Stack
from blocks.stack_file import read_stack_file
from deployments.cli import app

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----"


def stack_yaml(name: str = "hpc", compute: str = "", serving: str = "") -> str:
    compute = compute or textwrap.dedent("""\
          type: SlurmCluster
          host: login.hpc.example.org
          user: alice
          private_key: {file: id_ed25519}
          known_hosts: {file: known_hosts}
          partition: gpu""")
    serving = serving or "type: LocalServing"
    body = f"""\
stacks:
  {name}:
    provider: {{type: ClusterManaged, cluster_name: hpc}}
    images: {{type: CurrentEnvironment}}
    compute:
{textwrap.indent(compute, "      ")}
    storage:
      type: LocalCheckpointStore
      filesystem: {{basepath: /shared/checkpoints}}
    tracking: {{tracking_uri: http://mlflow.example.org:5000}}
    serving:
{textwrap.indent(serving, "      ")}
"""
    return body


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "id_ed25519").write_text(KEY + "\n")
    (tmp_path / "known_hosts").write_text("login.hpc.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK\n")
    return tmp_path


def read(text: str, base: Path) -> dict[str, Stack]:
    return read_stack_file(text, "stack.yaml", base)


def test_a_stack_file_gives_the_blocks_with_references_resolved(files: Path) -> None:
    stacks = read(stack_yaml(), files)
    stack = stacks["hpc"]
    assert isinstance(stack.compute, SlurmCluster)
    # The older flat login fields land in credentials (the file's content, its last newline dropped).
    assert stack.compute.credentials.private_key.get_secret_value() == KEY
    assert stack.compute.credentials.user == "alice" and stack.compute.user == "alice"
    assert stack.compute.partition == "gpu" and stack.compute.host == "login.hpc.example.org"
    assert stack.tracking.tracking_uri == "http://mlflow.example.org:5000"
    assert stack.storage.filesystem.basepath == "/shared/checkpoints"


def test_a_typo_names_the_file_line_field_and_the_valid_fields(files: Path) -> None:
    text = stack_yaml().replace("partition: gpu", "partiton: gpu")
    with pytest.raises(ConfigurationError) as err:
        read(text, files)
    message = str(err.value)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "partiton" in ln)
    assert f"stack.yaml:{line}: stacks.hpc.compute.partiton: unknown field of SlurmCluster; valid fields: " in message
    assert "partition" in message.split("valid fields:")[1] and "credentials" in message


def test_an_unknown_backend_lists_the_known_ones(files: Path) -> None:
    text = stack_yaml(serving="type: Kubernetes\nnamespace: models")
    with pytest.raises(
        ConfigurationError,
        match=r"stack\.yaml:\d+: stacks\.hpc\.serving\.type: unknown backend "
        r"'Kubernetes'; known: LocalServing, KubernetesCluster",
    ):
        read(text, files)


def test_a_missing_secret_and_a_written_secret_are_refused_naming_the_field(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUFERRY_TEST_KUBECONFIG", raising=False)
    text = stack_yaml(serving="type: KubernetesCluster\nkubeconfig: {env: GPUFERRY_TEST_KUBECONFIG}")
    with pytest.raises(
        ConfigurationError,
        match=r"stacks\.hpc\.serving\.kubeconfig: environment variable "
        "GPUFERRY_TEST_KUBECONFIG is not set",
    ):
        read(text, files)
    monkeypatch.setenv("GPUFERRY_TEST_KUBECONFIG", "apiVersion: v1")
    assert read(text, files)["hpc"].serving.kubeconfig.get_secret_value() == "apiVersion: v1"
    written = stack_yaml().replace("private_key: {file: id_ed25519}", "private_key: hunter2")
    with pytest.raises(ConfigurationError, match=r"stacks\.hpc\.compute\.private_key: is a secret: reference it"):
        read(written, files)
    missing_file = stack_yaml().replace("{file: id_ed25519}", "{file: no-such-key}")
    with pytest.raises(ConfigurationError, match=r"private_key: cannot read .*no-such-key"):
        read(missing_file, files)


def test_every_problem_is_reported_at_once_and_a_missing_step_lists_its_backends(files: Path) -> None:
    text = (
        stack_yaml().replace("partition: gpu", "partiton: gpu").replace("    images: {type: CurrentEnvironment}\n", "")
    )
    with pytest.raises(ConfigurationError) as err:
        read(text, files)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 2
    assert any("images is missing: give one of CurrentEnvironment, DockerImageBuilder" in ln for ln in lines)
    assert any("partiton: unknown field" in ln for ln in lines)


def test_nested_models_and_unions_take_their_fields_the_same_way(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFERRY_TEST_SECRET", "s3cr3t")
    storage = """\
type: S3CheckpointStore
bucket:
  bucket_name: models
  credentials:
    aws_access_key_id: AKIA
    aws_secret_access_key: {env: GPUFERRY_TEST_SECRET}
    aws_client_parameters: {endpoint_url: https://s3.example.org}"""
    text = stack_yaml().replace(
        """      type: LocalCheckpointStore
      filesystem: {basepath: /shared/checkpoints}
""",
        textwrap.indent(storage, "      ") + "\n",
    )
    store = read(text, files)["hpc"].storage
    assert type(store.bucket.credentials).__name__ == "AwsCredentials"  # told apart from MinIOCredentials by its fields
    assert store.bucket.credentials.aws_secret_access_key.get_secret_value() == "s3cr3t"
    typo = text.replace("bucket_name: models", "bucket_nme: models")
    with pytest.raises(
        ConfigurationError, match=r"stacks\.hpc\.storage\.bucket\.bucket_nme: unknown field of S3Bucket"
    ):
        read(typo, files)


NESTED = """\
type: SlurmCluster
host: login.hpc.example.org
credentials:
  user: alice
  private_key: {file: id_ed25519}
  known_hosts: {file: known_hosts}
partition: gpu"""


def test_the_login_in_credentials_gives_the_same_block_as_the_older_flat_fields(files: Path) -> None:
    nested, flat = read(stack_yaml(compute=NESTED), files)["hpc"], read(stack_yaml(), files)["hpc"]
    assert nested.compute.credentials.private_key.get_secret_value() == KEY
    assert nested.compute.model_dump() == flat.compute.model_dump()
    written = stack_yaml(compute=NESTED.replace("private_key: {file: id_ed25519}", "private_key: hunter2"))
    with pytest.raises(ConfigurationError, match=r"stacks\.hpc\.compute\.credentials\.private_key: is a secret"):
        read(written, files)


def test_a_login_given_both_flat_and_in_credentials_is_refused_naming_the_fields(files: Path) -> None:
    text = stack_yaml(compute=NESTED + "\nknown_hosts: other.example ssh-ed25519 AAAA\nuser: bob")
    with pytest.raises(ConfigurationError) as err:
        read(text, files)
    message = str(err.value)
    assert (
        "stacks.hpc.compute: SlurmCluster: known_hosts, user given both flat and in credentials: set them in "
        "credentials only" in message
    )
    assert "not-a-real-key" not in message and "AAAAC3NzaC1lZDI1NTE5AAAAIK" not in message


def test_a_bad_value_names_the_field_by_its_path_in_the_file(files: Path) -> None:
    text = stack_yaml().replace("partition: gpu", "partition: gpu\n      port: 70000")
    with pytest.raises(ConfigurationError, match=r"stack\.yaml:\d+: stacks\.hpc\.compute\.port: Input should be less"):
        read(text, files)


# ---- applied to a Prefect server ---------------------------------------------------------------------


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.usefixtures("prefect_server")
def test_apply_twice_changes_nothing_the_second_time(files: Path) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    path = files / "stack.yaml"
    path.write_text(stack_yaml(name))

    assert run("stack", "apply", str(path), "--dry-run") == (0, f"{name}: would be created\ndry run: nothing saved\n")
    assert name not in Stack.saved_names()
    assert run("stack", "apply", str(path)) == (0, f"{name}: created\n")
    assert run("stack", "apply", str(path)) == (0, f"{name}: unchanged\n")

    (files / "id_ed25519").write_text(KEY.replace("not-a-real", "another") + "\n")
    path.write_text(stack_yaml(name).replace("partition: gpu", "partition: a100"))
    code, out = run("stack", "apply", str(path), "--dry-run")
    assert code == 0 and out.splitlines() == [
        f"{name}: would be updated (2 changes)",
        "  compute.credentials.private_key: (secret) changed",
        "  compute.partition: 'gpu' → 'a100'",
        "dry run: nothing saved",
    ]
    assert "another" not in out
    assert Stack.load(name).compute.partition == "gpu"
    assert run("stack", "apply", str(path))[1].startswith(f"{name}: updated (2 changes)")
    assert Stack.load(name).compute.partition == "a100"
    assert run("stack", "apply", str(path)) == (0, f"{name}: unchanged\n")

    code, shown = run("stack", "show", name)
    assert code == 0 and "partition: a100" in shown and "private_key: '********'" in shown
    assert "not-a-real" not in shown and "another" not in shown
    code, listed = run("stack", "list")
    assert code == 0 and any(name in ln and "SlurmCluster" in ln for ln in listed.splitlines())


@pytest.mark.usefixtures("prefect_server")
def test_a_secret_reference_takes_the_value_of_a_prefect_secret_block(files: Path) -> None:
    from prefect.blocks.system import Secret

    name, secret = f"t-{uuid.uuid4().hex[:8]}", f"kubeconfig-{uuid.uuid4().hex[:8]}"
    value = "apiVersion: v1\nkind: Config\nclusters: []\n"
    Secret(value=value).save(secret)
    path = files / "stack.yaml"
    path.write_text(
        stack_yaml(name, serving=f"type: KubernetesCluster\nkubeconfig: {{secret: {secret}}}\nnamespace: m")
    )

    assert run("stack", "apply", str(path)) == (0, f"{name}: created\n")
    assert Stack.load(name).serving.kubeconfig.get_secret_value() == value
    code, shown = run("stack", "show", name)
    assert code == 0 and "kubeconfig: '********'" in shown and "clusters" not in shown

    text = path.read_text().replace(secret, "gpuferry-no-such-secret")
    path.write_text(text)
    code, out = run("stack", "apply", str(path))
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "gpuferry-no-such-secret" in ln)
    assert (
        code == 2
        and f"{path}:{line}: stacks.{name}.serving.kubeconfig: the Prefect Secret block "
        "'gpuferry-no-such-secret' does not exist: create it"
        in out
    )
    assert Stack.load(name).serving.kubeconfig.get_secret_value() == value  # nothing was saved


@pytest.mark.usefixtures("prefect_server")
def test_a_stack_that_is_not_saved_is_an_error_listing_the_saved_ones(files: Path) -> None:
    from flows.retrain import load_stack

    name = f"t-{uuid.uuid4().hex[:8]}"
    path = files / "stack.yaml"
    path.write_text(stack_yaml(name))
    assert run("stack", "apply", str(path))[0] == 0
    with pytest.raises(
        ConfigurationError,
        match=rf"stack='{name}x': no saved Stack block has that name; saved "
        rf"stacks: .*\b{name}\b",
    ):
        load_stack(f"{name}x")
    picked = Stack.load(name)
    assert load_stack(picked) is picked  # a block picked in the UI arrives as the block itself
    assert isinstance(load_stack(name).compute, SlurmCluster)
    code, out = run("stack", "show", f"{name}x")
    assert code == 2 and "saved stacks: " in out


def test_the_flows_stack_parameter_offers_the_saved_stack_blocks() -> None:
    """In the run form a block-typed parameter is a picker of the saved blocks; a name still validates."""
    from prefect.utilities.callables import parameter_schema

    from flows.deploy_model import deploy_model
    from flows.retrain import retrain
    from flows.sweep import sweep

    for flow in (retrain, sweep, deploy_model):
        schema = parameter_schema(flow).model_dump_for_openapi()
        options = schema["properties"]["stack"]["anyOf"]
        assert {"$ref": "#/definitions/Stack"} in options and {"type": "string"} in options, flow.name
        assert schema["definitions"]["Stack"]["block_type_slug"] == "gpuferry-stack"
    assert retrain.validate_parameters({"workload": "w", "stack": "hpc"})["stack"] == "hpc"
