"""Fetch, verify and load an MLflow model for the inference server (on the predict thread)."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import contract
from runtime.checkpoint import VerifiedCheckpoint, fetch_checkpoint
from runtime.settings import Settings, usable_cpus

log = logging.getLogger("runtime.serve")


@dataclass(frozen=True)
class LoadedModel:
    """What the predict thread loaded: the pyfunc model, its scorer and what /readyz may tell about it."""

    scorer: Any  # runtime.scoring.Scorer
    serving_input: str | None  # the model's own serving input example (JSON), if it was saved with one
    description: dict[str, Any]
    device: str  # where the model runs: "cpu", "cuda:0", ... (runtime.device)
    how: str = ""  # how it got there (runtime.device.Placed.how): "torch.export, moved from cpu to cuda:0", ...


def load(settings: Settings, scratch: Path) -> LoadedModel:
    """Fetch and verify the checkpoint, load it with ``mlflow.pyfunc`` on the device ``MODEL_DEVICE`` asks for
    (``runtime.device``), on the calling thread: the predict one."""
    checkpoint = fetch_checkpoint(settings.model_uri, scratch, settings.model_sha256)
    if not (checkpoint.path / "MLmodel").is_file():
        raise FileNotFoundError(
            f"{settings.model_uri} holds no MLmodel: the training job must write an MLflow model directory "
            f"(mlflow.<flavour>.save_model(model, path)) to {contract.CHECKPOINT_DIR}/{contract.FINAL_DIRNAME}/"
        )
    # MLflow is imported only now, after the checkpoint is known good (and off the event loop: it takes seconds).
    import mlflow
    from mlflow.models import Model

    from runtime.device import load_pyfunc
    from runtime.scoring import Scorer

    meta = Model.load(str(checkpoint.path))
    name = _model_name(settings, meta)
    log.info("loading the model %r (%s=%s)", name, contract.MODEL_DEVICE, settings.model_device)
    placed = load_pyfunc(checkpoint.path, meta, settings.model_device, name)
    log.info("the model %r is on %s (%s)", name, placed.device, placed.how)
    _tune_torch(settings)
    serving_input = meta.get_serving_input(str(checkpoint.path))
    return LoadedModel(
        Scorer(placed.model, settings.max_request_rows),
        serving_input,
        _describe_model(settings, meta, checkpoint, mlflow.__version__),
        placed.device,
        placed.how,
    )


def _model_name(settings: Settings, meta: Any) -> str:
    return settings.model_name or meta.artifact_path or "model"


def _tune_torch(settings: Settings) -> None:
    """torch's intra-op threads default to the host's cores, ignoring a container's limit, and oversubscribe; one
    core stays free for request handling. Only when the model loaded torch and OMP_NUM_THREADS does not say."""
    if "torch" not in sys.modules or (settings.torch_threads is None and os.environ.get("OMP_NUM_THREADS")):
        return
    import torch

    torch.set_num_threads(settings.torch_threads or max(1, usable_cpus() - 1))


def _describe_model(settings: Settings, meta: Any, checkpoint: VerifiedCheckpoint, mlflow_version: str) -> dict:
    signature = None
    if meta.signature is not None:  # its parts are JSON strings in MLmodel: objects here
        signature = {k: json.loads(v) if isinstance(v, str) else v for k, v in meta.signature.to_dict().items()}
    return {
        "name": _model_name(settings, meta),
        "flavors": sorted(meta.flavors),
        "loader_module": meta.flavors.get("python_function", {}).get("loader_module"),
        "signature": signature,
        "has_serving_input_example": bool(meta.saved_input_example_info),
        "model_uuid": meta.model_uuid,
        "model_id": getattr(meta, "model_id", None),
        "run_id": meta.run_id,
        "saved_with_mlflow": meta.mlflow_version,
        "served_with_mlflow": mlflow_version,
        "checkpoint_sha256": checkpoint.sha256,
        "files": checkpoint.files,
        "size_bytes": checkpoint.size_bytes,
    }
