"""Store the trained model: checked to be an MLflow model first, then stored with its manifest, both from where
the job wrote it (the compute backend says where that is: this machine, or a cluster that stores it itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from blocks.base.compute import ComputeBackend
from blocks.base.mlflow_model import ModelInfo, NoModel, parse_serving_example
from blocks.base.storage import CheckpointStore
from blocks.records import CheckpointRef
from runtime.mlmodel import MLMODEL, serving_example_path
from tasks.retry import retry_options


@task(name="inspect-model", **retry_options(retries=3))
def inspect_model(compute: ComputeBackend, final_dir: str) -> ModelInfo:
    """The MLflow model the job wrote (``NoModel`` when there is none: nothing is stored or registered)."""
    info = compute.inspect_model(final_dir)
    get_run_logger().info(
        "MLflow model in %s: flavours %s, %s, %s",
        final_dir,
        ", ".join(info.flavors),
        "with a signature" if info.signature else "no signature",
        f"serving example {info.serving_example}" if info.serving_example else "no serving input example",
    )
    return info


@task(name="store-model", **retry_options(retries=4))
def store_model(compute: ComputeBackend, store: CheckpointStore, final_dir: str, name: str) -> CheckpointRef:
    """Store the model where the job wrote it; unchanged files are not sent again, so a retry resumes."""
    ref = compute.store_model(final_dir, store, name)
    get_run_logger().info(
        "checkpoint %s: %d files, %d bytes (%d moved), sha256 %s",
        ref.uri,
        ref.files,
        ref.size_bytes,
        ref.bytes_uploaded,
        ref.sha256,
    )
    return ref


@task(name="upload-checkpoint", **retry_options(retries=4))
def upload_checkpoint(store: CheckpointStore, local_dir: str, name: str) -> CheckpointRef:
    """Store the directory with its manifest; an unchanged file is not sent again, so a retry resumes."""
    ref = store.put(Path(local_dir), name)
    get_run_logger().info(
        "checkpoint %s: %d files, %d bytes (%d moved), sha256 %s",
        ref.uri,
        ref.files,
        ref.size_bytes,
        ref.bytes_uploaded,
        ref.sha256,
    )
    return ref


@task(name="read-serving-example", **retry_options(retries=3))
def serving_example(store: CheckpointStore, uri: str, path: str) -> dict[str, Any]:
    """The model's own serving input example, read back from storage (checked against the manifest)."""
    raw = store.read_file(uri, path)
    if raw is None:
        raise NoModel(f"{uri}: the manifest does not list {path}, which the model's MLmodel names")
    return parse_serving_example(raw, f"{uri}/{path}")


@task(name="model-serving-example", **retry_options(retries=3))
def model_serving_example(store: CheckpointStore, uri: str) -> dict[str, Any] | None:
    """The serving input example of the MLflow model stored at ``uri`` (None when it has none)."""
    mlmodel = store.read_file(uri, MLMODEL)
    path = serving_example_path(mlmodel) if mlmodel is not None else None
    if path is None:
        return None
    raw = store.read_file(uri, path)
    return None if raw is None else parse_serving_example(raw, f"{uri}/{path}")
