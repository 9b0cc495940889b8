"""``gpuferry init``: a workload skeleton that passes ``gpuferry check`` and runs, to replace with your model.

It writes ``gpuferry.yaml`` (name, the image from ``Dockerfile``, the training command, two hyperparameters,
the promotion metric), ``train.py`` (a job that honours gpuferry's contract: ``HPARAMS`` in, metrics to
MLflow, an MLflow model with an input example in ``$CHECKPOINT_DIR/final/``, exit 75 when stopped by
SIGTERM/SIGUSR1 before it is done), ``requirements.txt`` and a ``Dockerfile`` (``python:3.11-slim`` unless the
build argument ``BASE_IMAGE`` says otherwise, ``requirements.txt`` and the model server's packages, the code in
``/workload``). The training script imports nothing of gpuferry. Existing files are left alone unless
``--force``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

WORKLOAD_YAML = """\
# gpuferry's workload definition (see the README's "Bring your own workload").
name: {name}
description: A ridge regression on scikit-learn's diabetes data; replace train.py with your model.

image:
  dockerfile: Dockerfile        # python:3.11-slim + requirements.txt + this directory; a stack may set BASE_IMAGE
  # base: python:3.11-slim      # or no Dockerfile: one is generated from this base and requirements.txt
  # requirements: requirements.txt

train:
  command: [python, train.py]
  resources: {{time_limit_minutes: 30, mem_gb: 2}}

hyperparameters:                # a JSON Schema: the run form and the checks before anything runs
  type: object
  properties:
    alpha: {{type: number, exclusiveMinimum: 0, default: 1.0, description: Strength of the L2 penalty.}}
    test_fraction: {{type: number, exclusiveMinimum: 0, maximum: 0.5, default: 0.2, description: Held-out share.}}

promotion:                      # a new version replaces the champion when it is better on this metric
  metric: val_rmse
  direction: minimize
"""

TRAIN_PY = '''\
"""Train the model and save it as an MLflow model: gpuferry stores, registers and serves what this writes.

The contract (nothing of gpuferry is imported): hyperparameters come as JSON in HPARAMS; MLflow logging goes
to MLFLOW_TRACKING_URI into the run MLFLOW_RUN_ID; the model goes to $CHECKPOINT_DIR/final/ with an input
example (the request a new version must answer before it serves); SIGTERM/SIGUSR1 before the end: exit 75.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_diabetes
from sklearn.linear_model import Ridge
from sklearn.metrics import mean_squared_error
from sklearn.model_selection import train_test_split

EXIT_PREEMPTED = 75  # "stopped before I was done: requeue me"
DEFAULTS = {"alpha": 1.0, "test_fraction": 0.2}
stopping = False


def stop(signum, frame):
    global stopping
    stopping = True


def main() -> int:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
    hp = {**DEFAULTS, **json.loads(os.environ.get("HPARAMS") or "{}")}
    checkpoints = Path(os.environ.get("CHECKPOINT_DIR", "checkpoints"))
    checkpoints.mkdir(parents=True, exist_ok=True)

    data = load_diabetes(as_frame=True)  # your data here
    x_train, x_val, y_train, y_val = train_test_split(data.data, data.target, test_size=hp["test_fraction"],
                                                      random_state=0)
    model = Ridge(alpha=hp["alpha"]).fit(x_train, y_train)  # your model here
    if stopping:
        return EXIT_PREEMPTED
    metrics = {"val_rmse": float(np.sqrt(mean_squared_error(y_val, model.predict(x_val))))}
    print(metrics, flush=True)

    import mlflow
    import mlflow.sklearn

    if os.environ.get("MLFLOW_TRACKING_URI"):
        with mlflow.start_run():  # MLFLOW_RUN_ID: the pipeline's own run
            mlflow.log_params(hp)
            mlflow.log_metrics(metrics)
    final = checkpoints / "final"
    tmp = checkpoints / f".final-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    import sklearn
    import skops

    mlflow.sklearn.save_model(model, str(tmp), input_example=x_val.head(2), pip_requirements=[
        f"scikit-learn=={sklearn.__version__}", f"skops=={skops.__version__}", f"numpy=={np.__version__}"])
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)  # complete or absent, never half-written
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

REQUIREMENTS = """\
# What train.py needs in the image (gpuferry adds its model server's own packages).
numpy>=1.26,<3
pandas>=2,<4
scikit-learn>=1.4,<2
skops>=0.10,<1
mlflow-skinny>=3.17,<4
"""

DOCKERFILE = """\
# The workload's image: train.py and what it needs. gpuferry builds it (the context: this directory after
# .dockerignore), then adds its model server (runtime/) and checks that the server's packages are installed.
# BASE_IMAGE: any image with Python 3 and pip; a stack's image builder may set it (build_args: a mirror, a
# CUDA image).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The packages in a layer of their own (changing the code does not reinstall them): train.py's, and the model
# server's, whose list gpuferry puts in the build context as .gpuferry/runtime/requirements.txt.
COPY requirements.txt /tmp/requirements/workload.txt
COPY .gpuferry/runtime/requirements.txt /tmp/requirements/runtime.txt
RUN python -m pip install --no-cache-dir -r /tmp/requirements/workload.txt -r /tmp/requirements/runtime.txt \\
    && rm -rf /tmp/requirements

WORKDIR /workload
COPY . /workload
"""

DOCKERIGNORE = """\
checkpoints/
mlruns/
.git/
__pycache__/
"""


def files(name: str) -> dict[str, str]:
    """The skeleton's files, by path relative to the workload's root."""
    return {"gpuferry.yaml": WORKLOAD_YAML.format(name=name), "train.py": TRAIN_PY,
            "requirements.txt": REQUIREMENTS, "Dockerfile": DOCKERFILE, ".dockerignore": DOCKERIGNORE}  # fmt: skip


def workload_name(directory: Path) -> str:
    """A valid workload name from the directory's name (lowercase letters, digits and '-')."""
    name = re.sub(r"[^a-z0-9-]+", "-", directory.resolve().name.lower()).strip("-")
    return name[:63] or "my-model"


def write(directory: Path, name: str | None = None, force: bool = False) -> list[Path]:
    """Write the skeleton into ``directory``; the files written (an existing one is kept unless ``force``)."""
    from blocks.specs import check_name

    directory.mkdir(parents=True, exist_ok=True)
    name = check_name(name or workload_name(directory), "--name")
    written = []
    for relative, text in files(name).items():
        path = directory / relative
        if path.exists() and not force:
            continue
        path.write_text(text)
        written.append(path)
    return written


def init(
    directory: Annotated[Path, typer.Argument(help="The workload's directory (your repository).")] = Path("."),
    name: Annotated[str | None, typer.Option(help="The workload's name (default: the directory's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that exist.")] = False,
) -> None:
    """Write a workload skeleton (gpuferry.yaml, train.py, requirements.txt, Dockerfile) that passes `check` and runs."""
    written = write(directory, name, force)
    kept = [p for p in files("x") if directory / p not in written]
    for path in written:
        typer.echo(f"wrote {path}")
    if kept:
        typer.echo(f"kept (exists; --force overwrites): {', '.join(kept)}")
    typer.echo(f"next: `gpuferry check STACK --workload {directory}`, then "
               f"`gpuferry run retrain --workload {directory} --stack STACK`")
