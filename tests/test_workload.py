"""The workload definition: gpuferry.yaml read from a path or a git URL, checked with errors that name the file,
the line and the field; hyperparameters checked against the workload's own JSON Schema; the code as one
content-addressed archive."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from blocks.errors import ConfigurationError
from blocks.plan import plan_run
from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
from blocks.workload.hparams import HyperparameterSchema
from blocks.workload.source import code_archive, load_workload, parse_git_source

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

MINIMAL = """\
name: house-prices
train:
  command: [python, train.py]
hyperparameters:
  type: object
  properties:
    alpha: {type: number, exclusiveMinimum: 0, default: 0.1}
    l1_ratio: {type: number, minimum: 0, maximum: 1, default: 0.5}
    solver: {enum: [cd, sgd], default: cd}
    layers: {type: array, items: {type: integer, minimum: 1}, default: [8]}
    extra: {type: object, properties: {depth: {type: integer, default: 3}}, default: {}}
  required: [alpha]
promotion: {metric: rmse, direction: minimize}
"""


def write(root: Path, text: str = MINIMAL, files: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "gpuferry.yaml").write_text(text)
    for name, content in {"train.py": "print('train')\n", **(files or {})}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


# ---- the file ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("  command: [python, train.py]", "  comand: [python, train.py]"),
            [
                "gpuferry.yaml:3: train.comand: unknown field; valid fields: command, env, secrets, resources",
                "train.command: required field is missing",
            ],
        ),
        (
            ("promotion: {metric: rmse, direction: minimize}", "promotion: {metric: rmse, direction: down}"),
            ["gpuferry.yaml:13: promotion.direction: Input should be 'maximize' or 'minimize'"],
        ),
        (
            ("name: house-prices", "name: house prices; rm -rf /"),
            ["gpuferry.yaml:1: name: name='house prices; rm -rf /'"],
        ),
        (
            ("name: house-prices", "name: house-prices\nimage: {dockerfile: Dockerfile, base: python:3.11}"),
            ["gpuferry.yaml:2: image: give exactly one of image.dockerfile"],
        ),
        (
            ("    alpha: {type: number, exclusiveMinimum: 0, default: 0.1}", "    alpha: {type: numbr}"),
            ["hyperparameters.properties.alpha.type: not a valid JSON Schema"],
        ),
        (
            (
                "    alpha: {type: number, exclusiveMinimum: 0, default: 0.1}",
                "    alpha: {type: number, minimum: 1, default: 0.1}",
            ),
            ["a declared default is not valid: hyperparameters.alpha: 0.1 is less than the minimum of 1"],
        ),
        (
            ("  command: [python, train.py]", "  command: [python, train.py]\n  secrets: {HF_TOKEN: hf_token_value}"),
            ["train.secrets: train.secrets['HF_TOKEN']='hf_token_value' must name a Prefect Secret block"],
        ),
        (
            (
                "promotion: {metric: rmse, direction: minimize}",
                "promotion: {metric: rmse, direction: minimize}\nserve: {health_path: /live}",
            ),
            ["serve.health_path describe your own server: set serve.command too"],
        ),
        (("train:", "train: [oops"), ["not valid YAML"]),
    ],
)
def test_a_bad_file_names_the_line_and_the_field(tmp_path: Path, edit: tuple[str, str], expected: list[str]) -> None:
    root = write(tmp_path / "w", MINIMAL.replace(*edit))
    with pytest.raises(ConfigurationError) as info:
        load_workload(str(root))
    message = str(info.value)
    for part in expected:
        assert part in message, message


def test_no_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="gpuferry.yaml does not exist; write one"):
        load_workload(str(tmp_path))
    with pytest.raises(ConfigurationError, match="no such directory"):
        load_workload(str(tmp_path / "missing"))


def test_the_bundled_examples_load() -> None:
    digits = load_workload(str(EXAMPLES / "digits"))
    diabetes = load_workload(str(EXAMPLES / "diabetes" / "gpuferry.yaml"))
    assert digits.definition.image.kind == "dockerfile" and digits.image_workdir() == "/workload"
    assert diabetes.definition.image.kind == "generated" and diabetes.image_workdir() == "/workload"
    assert digits.definition.schema.defaults["optimizer"] == "sgd"
    assert diabetes.definition.promotion.direction == "minimize"
    assert digits.commit == git(REPO, "rev-parse", "HEAD")


# ---- hyperparameters -------------------------------------------------------------------------------


def test_hyperparameters_take_defaults_and_refuse_unknown_keys_naming_the_valid_ones(tmp_path: Path) -> None:
    schema = load_workload(str(write(tmp_path / "w"))).definition.schema
    assert schema.validate({"alpha": 0.3}) == {
        "alpha": 0.3,
        "l1_ratio": 0.5,
        "solver": "cd",
        "layers": [8],
        "extra": {"depth": 3},
    }
    with pytest.raises(ConfigurationError) as info:
        schema.validate({"alpha": 0.3, "alhpa": 1, "extra": {"dpth": 2}})
    message = str(info.value)
    assert (
        "hyperparameters.alhpa: not a declared hyperparameter; valid: alpha, l1_ratio, solver, layers, extra" in message
    )
    assert "hyperparameters.extra.dpth: not a declared hyperparameter; valid: depth" in message


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"alpha": 0}, "hyperparameters.alpha: 0 is less than or equal to the minimum of 0"),
        ({"alpha": "0.1"}, "hyperparameters.alpha: '0.1' is not of type 'number'"),
        ({"alpha": 0.1, "solver": "lbfgs"}, "hyperparameters.solver: 'lbfgs' is not one of ['cd', 'sgd']"),
        ({"alpha": 0.1, "layers": [8, 0]}, "hyperparameters.layers[1]: 0 is less than the minimum of 1"),
        ({"alpha": 0.1, "extra": {"depth": "3"}}, "hyperparameters.extra.depth: '3' is not of type 'integer'"),
    ],
)
def test_bad_hyperparameters_name_the_field(tmp_path: Path, values: dict, problem: str) -> None:
    schema = load_workload(str(write(tmp_path / "w"))).definition.schema
    with pytest.raises(ConfigurationError) as info:
        schema.validate(values)
    assert problem in str(info.value)


def test_numbers_are_floats_whatever_the_form_wrote() -> None:
    # The UI (and YAML) write 0 for a float: the job would log 0.0 where the run's params say 0.
    schema = HyperparameterSchema(
        {
            "type": "object",
            "properties": {
                "dropout": {"type": "number", "default": 0},
                "epochs": {"type": "integer", "default": 3},
                "flag": {"type": "boolean", "default": True},
                "rates": {"type": "array", "items": {"type": "number"}},
                "inner": {"type": "object", "properties": {"w": {"type": "number"}}},
            },
        }
    )
    values = schema.validate({"rates": [1, 0.5], "inner": {"w": 2}})
    assert values == {"dropout": 0.0, "epochs": 3, "flag": True, "rates": [1.0, 0.5], "inner": {"w": 2.0}}
    assert [type(values[k]) for k in ("dropout", "epochs", "flag")] == [float, int, bool]
    assert type(values["inner"]["w"]) is float and [type(r) for r in values["rates"]] == [float, float]


def test_an_object_left_out_gets_its_fields_defaults_unless_it_would_lack_a_required_one() -> None:
    schema = HyperparameterSchema(
        {
            "type": "object",
            "properties": {
                "schedule": {
                    "type": "object",
                    "properties": {
                        "warmup": {"type": "integer", "default": 2},
                        "kind": {"enum": ["constant", "cosine"], "default": "cosine"},
                    },
                },
                "data": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "shuffle": {"type": "boolean", "default": True}},
                    "required": ["path"],
                },
                "empty": {"type": "object", "properties": {"note": {"type": "string"}}},
            },
        }
    )
    assert schema.defaults == {"schedule": {"warmup": 2, "kind": "cosine"}}
    assert schema.validate({"schedule": {"warmup": 5}}) == {"schedule": {"warmup": 5, "kind": "cosine"}}
    assert schema.validate({"data": {"path": "d.csv"}})["data"] == {"path": "d.csv", "shuffle": True}
    with pytest.raises(ConfigurationError, match=r"hyperparameters.data: 'path' is a required property"):
        schema.validate({"data": {}})


def test_required_without_default() -> None:
    schema = HyperparameterSchema({"type": "object", "properties": {"lr": {"type": "number"}}, "required": ["lr"]})
    with pytest.raises(ConfigurationError, match="hyperparameters: 'lr' is a required property"):
        schema.validate({})


def test_a_grid_takes_any_declared_hyperparameter_and_checks_each_configuration(tmp_path: Path) -> None:
    schema = load_workload(str(write(tmp_path / "w"))).definition.schema
    base = schema.validate({"alpha": 0.1})
    grid = schema.expand_grid(base, {"alpha": [0.01, 0.1], "solver": ["cd", "sgd"]}, [{"l1_ratio": 1.0}])
    assert [(c["alpha"], c["solver"], c["l1_ratio"]) for c in grid] == [
        (0.01, "cd", 0.5),
        (0.01, "sgd", 0.5),
        (0.1, "cd", 0.5),
        (0.1, "sgd", 0.5),
        (0.1, "cd", 1.0),
    ]
    with pytest.raises(
        ConfigurationError, match="grid: 'lr' is not a declared hyperparameter of the workload; valid: alpha"
    ):
        schema.expand_grid(base, {"lr": [0.1]}, [])
    with pytest.raises(
        ConfigurationError, match=r"(?s)grid: configuration 1 \{'alpha': -1\}: .*hyperparameters.alpha: -1"
    ):
        schema.expand_grid(base, {"alpha": [0.2, -1]}, [])


def test_the_run_plan_fills_in_the_workload_and_checks_before_anything_runs(tmp_path: Path) -> None:
    workload = load_workload(str(write(tmp_path / "w")))
    run = plan_run(workload, TrainingSpec(hyperparameters={"alpha": 0.2}), ServingSpec(), PromotionPolicy())
    assert (run.experiment, run.model_name, run.serving.service) == ("house-prices",) * 3
    assert (run.promotion.metric, run.promotion.direction) == ("rmse", "minimize")
    assert run.hyperparameters["alpha"] == 0.2 and run.hyperparameters["solver"] == "cd"
    job = run.job("k", "/jobs/k", None, env={"MLFLOW_RUN_ID": "r"})
    assert job.command == ["python", "train.py"] and job.code.root == str(tmp_path / "w")
    assert '"alpha": 0.2' in job.env["HPARAMS"] and job.env["CHECKPOINT_EVERY"] == "50"
    with pytest.raises(ConfigurationError, match=r"training.hyperparameters do not match the workload's schema"):
        plan_run(workload, TrainingSpec(hyperparameters={"alpha": -1}), ServingSpec(), PromotionPolicy())


def test_a_runs_resources_go_over_the_workloads_field_by_field(tmp_path: Path) -> None:
    """`-p training.resources.qos=preemptible` changes the QoS only: the workload's GPUs and time limit stay."""
    text = MINIMAL.replace(
        "  command: [python, train.py]\n",
        "  command: [python, train.py]\n  resources: {gpus_per_node: 2, time_limit_minutes: 240, qos: high}\n",
    )
    workload = load_workload(str(write(tmp_path / "w", text)))
    assert workload.definition.train.resources.qos == "high"
    spec = TrainingSpec.model_validate({"resources": {"qos": "preemptible", "nice": 10}})
    run = plan_run(workload, spec, ServingSpec(), PromotionPolicy())
    assert (run.resources.qos, run.resources.nice) == ("preemptible", 10)
    assert (run.resources.gpus_per_node, run.resources.time_limit_minutes) == (2, 240)
    same = plan_run(workload, TrainingSpec(), ServingSpec(), PromotionPolicy())
    assert same.resources == workload.definition.train.resources


# ---- git sources and the code archive ------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        (
            "git+https://example.com/team/models.git@main#subdirectory=house",
            ("https://example.com/team/models.git", "main", "house"),
        ),
        ("git+ssh://git@example.com/team/models.git", ("ssh://git@example.com/team/models.git", None, None)),
        ("git+ssh://git@example.com/team/models.git@v1.2", ("ssh://git@example.com/team/models.git", "v1.2", None)),
        ("git+file:///srv/models.git@0123abc", ("file:///srv/models.git", "0123abc", None)),
    ],
)
def test_git_sources_in_pips_form(source: str, parsed: tuple) -> None:
    assert parse_git_source(source) == parsed


def test_git_source_errors() -> None:
    with pytest.raises(ConfigurationError, match="only fragment understood is #subdirectory"):
        parse_git_source("git+https://example.com/m.git#egg=x")
    with pytest.raises(ConfigurationError, match="must be a relative path"):
        parse_git_source("git+https://example.com/m.git#subdirectory=../etc")


def test_a_workload_from_git_at_a_ref_records_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    write(repo / "models" / "house", files={"lib/util.py": "X = 1\n"})
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    first = git(repo, "rev-parse", "HEAD")
    git(repo, "tag", "v1")
    (repo / "models" / "house" / "train.py").write_text("print('v2')\n")
    git(repo, "commit", "-q", "-am", "second")
    second = git(repo, "rev-parse", "HEAD")

    at_tag = load_workload(f"git+file://{repo}@v1#subdirectory=models/house")
    at_main = load_workload(f"git+file://{repo}@main#subdirectory=models/house")
    assert (at_tag.commit, at_main.commit) == (first, second)
    assert Path(at_tag.root, "train.py").read_text() == "print('train')\n"
    assert Path(at_main.root, "train.py").read_text() == "print('v2')\n"
    assert at_tag.code.sha256 != at_main.code.sha256 and not at_main.dirty
    with tarfile.open(at_tag.code.archive) as tar:
        assert sorted(tar.getnames()) == ["gpuferry.yaml", "lib/util.py", "train.py"]
    with pytest.raises(ConfigurationError, match="has no branch, tag or commit 'nope'"):
        load_workload(f"git+file://{repo}@nope")
    with pytest.raises(ConfigurationError, match="cannot fetch"):
        load_workload(f"git+file://{tmp_path}/no-such-repo.git")


def test_the_code_of_a_git_source_is_the_commits_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden files the commit holds are in it; what a job run from the unpacked tree wrote there is not; and it is
    the same archive as that of a clean clone of the commit."""
    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    write(repo / "house", files={".config/settings.json": "{}\n", "lib/util.py": "X = 1\n"})
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    source = f"git+file://{repo}@main#subdirectory=house"
    loaded = load_workload(source)
    with tarfile.open(loaded.code.archive) as tar:
        assert sorted(tar.getnames()) == [".config/settings.json", "gpuferry.yaml", "lib/util.py", "train.py"]
    assert loaded.code.sha256 == code_archive(repo / "house").sha256  # the work tree at that commit
    # A job ran from the unpacked tree (local processes do) and left files behind: the code is still the commit's.
    (Path(loaded.root) / "lib" / "__pycache__").mkdir()
    (Path(loaded.root) / "lib" / "__pycache__" / "util.cpython-311.pyc").write_bytes(b"\0")
    (Path(loaded.root) / "out.txt").write_text("written by a job\n")
    assert load_workload(source).code.sha256 == loaded.code.sha256


def test_the_code_archive_names_its_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    root = write(tmp_path / "w", files={"pkg/model.py": "W = 2\n", ".hidden/x": "no", "__pycache__/a.pyc": "no"})
    first = load_workload(str(root)).code
    os.utime(root / "train.py", (1, 1))  # timestamps do not count
    assert load_workload(str(root)).code.sha256 == first.sha256
    (root / "pkg" / "model.py").write_text("W = 3\n")
    assert load_workload(str(root)).code.sha256 != first.sha256
    with tarfile.open(first.archive) as tar:
        assert sorted(tar.getnames()) == ["gpuferry.yaml", "pkg/model.py", "train.py"]
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_a_local_workload_in_git_takes_what_git_would_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    root = write(tmp_path / "w", files={".gitignore": "data/\n", "data/big.bin": "x" * 100})
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "c")
    clean = load_workload(str(root))
    assert clean.commit == git(root, "rev-parse", "HEAD") and not clean.dirty
    (root / "notes.txt").write_text("untracked, not ignored\n")
    dirty = load_workload(str(root))
    assert dirty.dirty
    with tarfile.open(dirty.code.archive) as tar:
        assert sorted(tar.getnames()) == [".gitignore", "gpuferry.yaml", "notes.txt", "train.py"]
    assert dirty.run_tags()["gpuferry.workload.dirty"] == "true"


@pytest.mark.parametrize("in_git", [True, False])
def test_the_code_archive_never_takes_gpuferrys_state_or_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_git: bool
) -> None:
    """gpuferry's state in the workload's directory (``./.gpuferry``, or $GPUFERRY_HOME pointed inside it: an MLflow
    store, the hash cache) and git's own files are not the workload's code, ignored by .gitignore or not."""
    monkeypatch.setenv("GPUFERRY_CACHE", str(tmp_path / "cache"))
    root = write(tmp_path / "w", files={".gpuferry/mlflow.db": "db", "state/cache/sha256.json": "{}"})
    monkeypatch.setenv("GPUFERRY_HOME", str(root / "state"))
    if in_git:
        git(root, "init", "-q")
    work = load_workload(str(root))
    with tarfile.open(work.code.archive) as tar:
        assert sorted(tar.getnames()) == ["gpuferry.yaml", "train.py"]
    assert work.code.files == 2


SHAPED = (
    MINIMAL
    + """\
serve:
  service_name: houses
  replicas: 2
  max_replicas: 5
  gpus: 1
  cpu_request: "2"
  memory_limit: 8Gi
  url: https://houses.models.example.org
"""
)


def test_the_serving_shape_is_declared_in_the_workload_and_recorded_on_the_version(tmp_path: Path) -> None:
    """serve: declares the shape; a run takes it, overriding field by field what its own serving sets; the model
    version's tags record the shape the run served with (what deploy-model serves again)."""
    import json

    from blocks.plan import SERVING_TAG
    from blocks.records import ImageRef
    from blocks.specs import ServingShape

    work = load_workload(str(write(tmp_path / "w", SHAPED)))
    declared = work.definition.serve.shape()
    assert (declared.replicas, declared.max_replicas, declared.gpus) == (2, 5, 1)
    assert (declared.cpu_request, declared.memory_limit, declared.memory_request) == ("2", "8Gi", None)

    run = plan_run(work, TrainingSpec(hyperparameters={"alpha": 0.2}), ServingSpec(), PromotionPolicy())
    assert run.serving.service == "houses" and (run.serving.replicas, run.serving.gpus) == (2, 1)
    assert run.serving.url == "https://houses.models.example.org" and run.serving.device == "cuda"

    # The run sets replicas and a MIG slice: those are its, the rest the workload's (a MIG slice replaces the
    # declared whole GPU: the GPU fields go together).
    override = ServingSpec(replicas=3, mig_profile="1g.10gb")
    run = plan_run(work, TrainingSpec(hyperparameters={"alpha": 0.2}), override, PromotionPolicy())
    assert (run.serving.replicas, run.serving.gpus, run.serving.mig_profile) == (3, 0, "1g.10gb")
    assert (run.serving.max_replicas, run.serving.cpu_request) == (5, "2")

    tags = run.version_tags(ImageRef(builder="docker", content_tag="t", reference=None))
    recorded = ServingShape.model_validate_json(tags[SERVING_TAG])
    assert recorded == run.serving.shape()
    assert json.loads(tags[SERVING_TAG]) == {
        "replicas": 3,
        "max_replicas": 5,
        "mig_profile": "1g.10gb",
        "cpu_request": "2",
        "memory_limit": "8Gi",
        "url": "https://houses.models.example.org",
    }


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("  memory_limit: 8Gi", "  memory_limit: 8 gigs"),
            "gpuferry.yaml:20: serve.memory_limit: memory_limit='8 gigs' is not a Kubernetes quantity",
        ),
        (("  max_replicas: 5", "  max_replicas: 1"), "max_replicas=1 is below replicas=2"),
        (("  gpus: 1", "  gpus: 1\n  mig_profile: 1g.10gb"), "set either gpus or mig_profile, not both"),
        (("  replicas: 2", "  replicaz: 2"), "serve.replicaz: unknown field"),
    ],
)
def test_a_bad_serving_shape_names_the_file_line_and_field(
    tmp_path: Path, edit: tuple[str, str], expected: str
) -> None:
    root = write(tmp_path / "w", SHAPED.replace(*edit))
    with pytest.raises(ConfigurationError) as info:
        load_workload(str(root))
    assert expected in str(info.value) and "gpuferry.yaml:" in str(info.value), str(info.value)
