"""Bad input fails before any side effect; tasks retry transient errors only."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow

from blocks.errors import ConfigurationError, TransientError
from blocks.local.storage import LocalCheckpointStore
from blocks.records import CheckpointRef
from blocks.specs import Resources, ServingSpec, TrainingSpec
from flows.retrain import retrain
from tasks.upload import upload_checkpoint
from tests.examples import DIGITS

pytestmark = pytest.mark.usefixtures("prefect_server")


def _side_effects(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if "prefect" not in p.parts)


def test_invalid_parameter_rejected_naming_the_field(gpuferry_home: Path) -> None:
    before = _side_effects(gpuferry_home)
    with pytest.raises(ConfigurationError) as info:
        retrain(workload=str(DIGITS), training={"hyperparameters": {"lr": -1}})
    assert "hyperparameters.lr: -1 is less than or equal to the minimum of 0" in str(info.value)
    assert _side_effects(gpuferry_home) == before
    with pytest.raises(Exception, match="resources.nodes"):  # pydantic, before the flow runs at all
        retrain(workload=str(DIGITS), training={"resources": {"nodes": 0}})
    assert _side_effects(gpuferry_home) == before


def test_a_remote_cluster_with_a_file_tracking_uri_is_refused_before_the_cluster_is_contacted(
    gpuferry_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs of a cluster reached over SSH could not log to this machine's SQLite file: retrain refuses the
    stack in its preflight, before any SSH connection, command or submit, and before an MLflow run exists."""
    import uuid

    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters
    from pydantic import SecretStr

    from blocks.slurm.cluster import SlurmCluster
    from blocks.ssh.credentials import SshCredentials
    from blocks.stack import Stack
    from blocks.storage.s3 import S3CheckpointStore
    from blocks.tracking.mlflow import MlflowTracking

    contacted: list[str] = []

    def never(what: str):  # type: ignore[no-untyped-def]
        def reached(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            contacted.append(what)
            raise AssertionError(f"the cluster was reached ({what}) before the stack's mistake was reported")

        return reached

    for method in ("_new_session", "run", "submit", "submit_command"):
        monkeypatch.setattr(SlurmCluster, method, never(method))
    tracking_db = tmp_path / "mlflow.db"
    stack = Stack.embedded()
    login = SshCredentials(user="alice", private_key=SecretStr("unused"))
    stack.compute = SlurmCluster(
        host="login.hpc.invalid", credentials=login, workdir_root="/shared/gpuferry", partition="gpu"
    )
    stack.storage = S3CheckpointStore(
        bucket=S3Bucket(
            bucket_name="models",
            credentials=AwsCredentials(
                aws_access_key_id="AKIDEXAMPLE",
                aws_secret_access_key="unused",
                region_name="us-east-1",
                aws_client_parameters=AwsClientParameters(endpoint_url="http://s3.hpc.invalid:9000"),
            ),
        )
    )
    stack.tracking = MlflowTracking(tracking_uri=f"sqlite:///{tracking_db}")
    name = f"remote-sqlite-{uuid.uuid4().hex[:8]}"
    stack.save(name)
    before = _side_effects(gpuferry_home)
    with pytest.raises(
        ConfigurationError,
        match=r"tracking.tracking_uri='sqlite:///.*mlflow.db' is a file on this "
        r"machine: the jobs on the Slurm cluster \(login.hpc.invalid\)",
    ):
        retrain(workload=str(DIGITS), stack=name)
    assert contacted == []
    assert not tracking_db.exists()  # no MLflow experiment or run was made
    assert _side_effects(gpuferry_home) == before  # nothing acquired, built or shipped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"training": TrainingSpec(resources=Resources(nodes=2))}, "resources.nodes=2"),
        ({"serving": ServingSpec(mig_profile="1g.10gb")}, "local serving cannot pin a MIG slice"),
    ],
)
def test_backend_preflight_before_anything_runs(gpuferry_home: Path, kwargs: dict, message: str) -> None:
    before = _side_effects(gpuferry_home)
    with pytest.raises(ConfigurationError, match=message):
        retrain(workload=str(DIGITS), **kwargs)
    assert _side_effects(gpuferry_home) == before  # no job dir, no MLflow run, no checkpoint


class FlakyStore(LocalCheckpointStore):
    """Fails as told before succeeding; counts attempts in a file (tasks may run in other threads)."""

    _block_type_name = "Flaky Test Store"

    failures: list[str] = []
    counter: str = ""

    def put(self, local_dir: str | Path, name: str) -> CheckpointRef:
        counter = Path(self.counter)
        attempt = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(attempt + 1))
        if attempt < len(self.failures):
            raise {"transient": TransientError("503 Slow Down"), "config": ConfigurationError("bad bucket")}[
                self.failures[attempt]
            ]
        return super().put(local_dir, name)


def _run_upload(store: FlakyStore, src: Path) -> CheckpointRef:
    fast = upload_checkpoint.with_options(retry_delay_seconds=[0.05, 0.05, 0.05, 0.05])

    @flow
    def once() -> CheckpointRef:
        return fast(store, str(src), "m/r")

    return once()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"w" * 100)
    return tmp_path / "ckpt"


def test_transient_errors_are_retried(tmp_path: Path, src: Path) -> None:
    store = FlakyStore(failures=["transient", "transient"], counter=str(tmp_path / "n"))
    store.filesystem.basepath = str(tmp_path / "store")
    ref = _run_upload(store, src)
    assert ref.files == 1
    assert (tmp_path / "n").read_text() == "3"


def test_non_transient_error_is_not_retried(tmp_path: Path, src: Path) -> None:
    store = FlakyStore(failures=["config", "config"], counter=str(tmp_path / "n"))
    with pytest.raises(ConfigurationError, match="bad bucket"):
        _run_upload(store, src)
    assert (tmp_path / "n").read_text() == "1"


def test_saved_stack_is_loaded_by_name(tmp_path: Path) -> None:
    from blocks.stack import Stack
    from flows.retrain import load_stack

    stack = Stack.embedded()
    stack.storage.filesystem.basepath = str(tmp_path / "elsewhere")
    stack.save("team-default", overwrite=True)
    loaded = load_stack("team-default")
    assert loaded.backends() == stack.backends()
    assert loaded.storage.root() == tmp_path / "elsewhere" / "checkpoints"
    assert load_stack(None).backends() == stack.backends()


def test_container_serving_needs_a_stack_that_builds_an_image(gpuferry_home: Path) -> None:
    from blocks.kubernetes.cluster import KubernetesCluster
    from blocks.plan import plan_run
    from blocks.specs import PromotionPolicy
    from blocks.stack import Stack
    from blocks.workload.source import load_workload
    from flows.retrain import preflight

    blocks = Stack.embedded()
    blocks.serving = KubernetesCluster(namespace="serving")
    run = plan_run(load_workload(str(DIGITS)), TrainingSpec(), ServingSpec(), PromotionPolicy())
    with pytest.raises(
        ConfigurationError, match=r"stack.images \(CurrentEnvironment\) builds none.*DockerImageBuilder"
    ):
        preflight(blocks, run)
