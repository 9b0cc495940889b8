"""The contract between gpuferry and a workload, written down once.

A workload (the training job or its own inference server) never imports gpuferry: every
compute backend (local processes, Slurm, containers) hands it these variables, and it
reports back only through the files and exit codes named here, and through the MLflow
model it saves. gpuferry reads the names from this module; the workload reads them from
its environment. What the workload is (its command, image, hyperparameters' JSON Schema,
promotion metric, server) is declared in its own ``gpuferry.yaml``.

Training job
------------
``CHECKPOINT_DIR``      Directory the job owns for checkpoints. It must survive a
                        restart (on Slurm: a path on the shared filesystem). The job
                        writes ``step-<NNNNNNNN>/`` directories atomically (write to a
                        temporary name, then rename) and, when finished, ``final/``.
                        A restarted job resumes from the newest ``step-*`` directory.
``CHECKPOINT_EVERY``    Save a checkpoint every this many optimizer steps.
``HPARAMS``             JSON object of hyperparameters, checked against the schema the
                        workload's gpuferry.yaml declares, its defaults filled in.
``PROGRESS_FILE``       JSON file the job rewrites atomically while it runs:
                        ``{"step", "total_steps", "epoch", "metrics": {...}}``.
``MLFLOW_TRACKING_URI`` Where to log. With ``MLFLOW_RUN_ID`` set the job logs into the
``MLFLOW_RUN_ID``       pipeline's run instead of creating one (MLflow honours both).
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
                        Set by torchrun for multi-process jobs. Only rank 0 logs and
                        writes checkpoints.

Exit codes of the training job:

``0``                    finished; ``CHECKPOINT_DIR/final/`` holds the model.
``EXIT_PREEMPTED`` (75)  stopped by SIGTERM/SIGUSR1 after saving a checkpoint: requeue
                         it and it resumes (EX_TEMPFAIL).
anything else            failed — unless ``CHECKPOINT_DIR/PREEMPTED`` exists: under torchrun the
                         launcher exits 1 when a worker exits 75, so rank 0 leaves that marker.

``final/`` is an MLflow model directory, any flavour (``mlflow.<flavour>.save_model(model,
f"{CHECKPOINT_DIR}/final", input_example=...)``): an ``MLmodel`` file and the flavour's
files. gpuferry checks that ``MLmodel`` is there and readable before it stores or
registers anything; a job that wrote none fails saying so. Its serving input example
(written by MLflow when the model is saved with ``input_example``) is the request a new
version must answer before traffic moves to it. The job's metrics go to MLflow (the
promotion metric among them).

Inference server
----------------
``python -m runtime.serve`` (``runtime/serve.py``) serves any MLflow pyfunc model, with the user's code and
framework in its process (their image, or their environment).

``MODEL_URI``           Path, ``file://`` or ``s3://`` URI of a stored checkpoint: an MLflow model directory
                        (``MLmodel`` and its flavour's files) with the manifest below.
``HOST``, ``PORT``      Where to listen (default 127.0.0.1:8080).
``MODEL_DEVICE``        Where the model runs: ``auto`` (default: ``cuda`` when torch sees a GPU and
                        ``CUDA_VISIBLE_DEVICES`` is not empty, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``.
                        Serving backends set it explicitly: ``cuda`` for a service given GPUs; ``cpu`` with
                        ``CUDA_VISIBLE_DEVICES=""`` for one without (it then takes no GPU memory). Torch models are
                        put there by the server (``runtime/device.py``); other flavours load where MLflow puts
                        them. A model that cannot go there is not served (the server exits 1, saying why).
``MAX_BATCH_SIZE``, ``MAX_BATCH_WAIT_MS``, ``MAX_QUEUE``
                        Dynamic batching and overload settings (more in ``runtime/serve.py``).
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_CA_BUNDLE``
                        For ``s3://`` model URIs (boto3's own names).
Endpoints: ``POST /invocations`` (MLflow's scoring protocol: JSON with one of ``dataframe_split``,
``dataframe_records``, ``instances``, ``inputs`` and optional ``params``, or ``text/csv`` → ``{"predictions":
...}`` as ``mlflow models serve`` answers; 422 names what does not match the model's signature; 503 with
``Retry-After`` when overloaded), ``GET /ping`` and ``/health`` (MLflow's), ``GET /healthz`` (liveness),
``GET /readyz`` (readiness: 200 once loaded and warmed up with the model's own serving input example, 503 before
and while draining; its ``device`` says where the model runs), ``GET /version`` (the MLflow version, with an
``X-Model-Device`` header once loaded), ``GET /metrics`` (Prometheus). The server serves only a checkpoint whose
manifest (below) matches every file it lists; otherwise it exits 1 without becoming ready.

Checkpoint manifest
-------------------
A stored checkpoint directory holds ``MANIFEST.json``, written last by gpuferry's checkpoint
stores: ``{"format": 1, "files": [{"path", "size", "sha256"}, ...]}``, one entry per file
(``path`` relative, ``/``-separated, sorted; the manifest itself not listed), encoded by
``manifest_bytes``. The checkpoint's identity is the sha256 of those bytes. Readers trust only
a checkpoint that has a manifest, and only files whose size and sha256 match it.
"""

from __future__ import annotations

import json
from typing import Any

# Training job
CHECKPOINT_DIR = "CHECKPOINT_DIR"
CHECKPOINT_EVERY = "CHECKPOINT_EVERY"
HPARAMS = "HPARAMS"
PROGRESS_FILE = "PROGRESS_FILE"
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"

FINAL_DIRNAME = "final"
CHECKPOINT_PREFIX = "step-"

EXIT_OK = 0
EXIT_PREEMPTED = 75
# Written into CHECKPOINT_DIR by rank 0 when it stops for preemption, removed when a run starts: a
# launcher such as torchrun reports its own exit code (1), so the marker is what says "preempted".
PREEMPTED_MARKER = "PREEMPTED"

# Inference server
MODEL_URI = "MODEL_URI"
HOST = "HOST"
PORT = "PORT"
MAX_BATCH_SIZE = "MAX_BATCH_SIZE"
MAX_BATCH_WAIT_MS = "MAX_BATCH_WAIT_MS"
MAX_QUEUE = "MAX_QUEUE"
# The sha256 of the checkpoint's manifest as the model version records it: the server refuses another.
MODEL_SHA256 = "MODEL_SHA256"
# Where the model runs: auto (default), cpu, cuda or cuda:N (runtime/device.py).
MODEL_DEVICE = "MODEL_DEVICE"
# A JSON file the server reads again when it changes: a canary or a shadow set while it runs (runtime/route.py).
ROUTE_FILE = "ROUTE_FILE"


# Checkpoint manifest (the format above; gpuferry's stores write it, the inference server checks it)
MANIFEST_FILENAME = "MANIFEST.json"
MANIFEST_FORMAT = 1


class ManifestError(ValueError):
    """A manifest that is not in the format above, or that names a path outside its checkpoint."""


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest's stored bytes: sorted keys, no spaces, so the same files give the same sha256."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """A stored manifest, checked: known format, typed entries, every path relative and inside the checkpoint."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        ok = manifest.get("format") == MANIFEST_FORMAT and all(
            isinstance(e["path"], str) and isinstance(e["size"], int) and isinstance(e["sha256"], str) for e in files
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ManifestError(f"{where}: {MANIFEST_FILENAME} is not a gpuferry manifest (format {MANIFEST_FORMAT})")
    for entry in files:
        parts = entry["path"].split("/")
        if entry["path"].startswith("/") or ".." in parts or "" in parts or entry["path"] == MANIFEST_FILENAME:
            raise ManifestError(f"{where}: {MANIFEST_FILENAME} lists an unsafe path {entry['path']!r}")
    return manifest
