"""``gpuferry init``: a workload skeleton that passes ``gpuferry check`` and runs, to replace with your model.

It writes ``gpuferry.yaml`` (name, the image from ``Dockerfile``, the training command, hyperparameters, the
promotion metric), ``train.py`` (a job that honours gpuferry's contract: ``HPARAMS`` in, metrics to MLflow, an
MLflow model with an input example in ``$CHECKPOINT_DIR/final/``, exit 75 when stopped by SIGTERM/SIGUSR1 before
it is done), ``requirements.txt`` and a ``Dockerfile`` (``BASE_IMAGE``, a build argument, or its default, then
``requirements.txt`` and the model server's packages, the code in ``/workload``). Two templates:

* ``sklearn`` (the default): scikit-learn's Ridge on its diabetes data, on ``python:3.11-slim``;
* ``pytorch``: a small torch classifier that checkpoints to ``$CHECKPOINT_DIR`` every ``CHECKPOINT_EVERY`` steps,
  resumes from its newest checkpoint, and on SIGTERM/SIGUSR1 saves one and exits 75; its model is saved with
  ``mlflow.pytorch`` and a two-row input example; on ``pytorch/pytorch`` (torch from the base image).

``--example digits|diabetes`` writes one of the bundled examples instead (``examples/``, shipped in the package
as ``deployments/examples``). The training scripts import nothing of gpuferry. Existing files are left alone
unless ``--force``.
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
.gpuferry/
__pycache__/
"""

# gpuferry's state (its local MLflow store, caches, job directories) and what a local run writes: not the code.
GITIGNORE = """\
.gpuferry/
checkpoints/
mlruns/
__pycache__/
*.pyc
"""


TORCH_WORKLOAD_YAML = """\
# gpuferry's workload definition (every field: the docs' reference/workload-file page).
name: {name}
description: A small PyTorch classifier that checkpoints and resumes; replace train.py's model and data with yours.

image:
  dockerfile: Dockerfile        # BASE_IMAGE (a build argument, a stack's build_args) brings Python and torch

train:
  command: [python, train.py]   # under torchrun when the resources ask for more than one process or node
  checkpoint_every: 20          # CHECKPOINT_EVERY: optimizer steps between checkpoints
  resources: {{time_limit_minutes: 30}}

hyperparameters:                # a JSON Schema: the run form and the checks before anything runs
  type: object
  properties:
    epochs: {{type: integer, minimum: 1, maximum: 10000, default: 10, description: Passes over the training data.}}
    lr: {{type: number, exclusiveMinimum: 0, maximum: 10, default: 0.05, description: Learning rate (SGD).}}
    hidden: {{type: integer, minimum: 1, maximum: 4096, default: 32, description: Width of the hidden layer.}}
    batch_size: {{type: integer, minimum: 1, maximum: 4096, default: 32, description: Rows per optimizer step.}}

promotion:                      # a new version replaces the champion when it is better on this metric
  metric: val_accuracy
  direction: maximize
"""

TORCH_TRAIN_PY = '''\
"""Train a small PyTorch classifier and save it as an MLflow model: gpuferry stores, registers and serves it.

The contract (nothing of gpuferry is imported): hyperparameters come as JSON in HPARAMS; checkpoints go to
CHECKPOINT_DIR as step-<N>/ directories, written atomically every CHECKPOINT_EVERY steps, and a restarted job
resumes from the newest; SIGTERM/SIGUSR1 (preemption, the time limit's warning) saves a checkpoint and exits 75
("requeue me"); MLflow logging goes to MLFLOW_TRACKING_URI into the run MLFLOW_RUN_ID; progress goes to
PROGRESS_FILE; the model goes to $CHECKPOINT_DIR/final/ with a two-row input example (the request a new version
must answer before it serves). Replace make_data() and build_model() with yours.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

EXIT_PREEMPTED = 75  # "stopped before I was done: requeue me"
DEFAULTS = {"epochs": 10, "lr": 0.05, "hidden": 32, "batch_size": 32}
N_FEATURES, N_CLASSES = 8, 3
stopping = False


def stop(signum, frame):
    global stopping
    stopping = True


def make_data(seed: int = 0):
    """Your data here: three noisy clusters in 8 dimensions, split into training and validation rows."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2, size=(N_CLASSES, N_FEATURES))
    y = rng.integers(0, N_CLASSES, size=600)
    x = (centers[y] + rng.normal(0, 1, size=(600, N_FEATURES))).astype(np.float32)
    return (x[:480], y[:480]), (x[480:], y[480:])


def build_model(hidden: int) -> nn.Module:
    """Your model here."""
    return nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


def write_atomically(target: Path, write) -> None:
    """Create the directory ``target`` with ``write(tmp)`` so that it is either absent or complete."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp / "state.pt")

    write_atomically(root / f"step-{step:08d}", write)
    for old in sorted(root.glob("step-*"))[:-2]:  # keep the two newest
        shutil.rmtree(old, ignore_errors=True)


def resume(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint; the step it was taken at (0: none)."""
    found = sorted(p for p in root.glob("step-*") if (p / "state.pt").is_file())
    if not found:
        return 0
    state = torch.load(found[-1] / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed from {found[-1].name}", flush=True)
    return int(state["step"])


def main() -> int:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
    hp = {**DEFAULTS, **json.loads(os.environ.get("HPARAMS") or "{}")}
    root = Path(os.environ.get("CHECKPOINT_DIR", "checkpoints"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "PREEMPTED").unlink(missing_ok=True)
    every = int(os.environ.get("CHECKPOINT_EVERY") or 20)
    progress = os.environ.get("PROGRESS_FILE")
    torch.manual_seed(0)

    (x_train, y_train), (x_val, y_val) = make_data()
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    model = build_model(hp["hidden"])
    optimizer = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9)
    steps_per_epoch = -(-len(x_train) // hp["batch_size"])
    total = hp["epochs"] * steps_per_epoch
    step = resume(root, model, optimizer)

    import mlflow

    tracking = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    if tracking:
        mlflow.start_run()  # MLFLOW_RUN_ID: the pipeline's own run
        mlflow.log_params({k: str(v) for k, v in hp.items()})
    while step < total:
        epoch, batch = divmod(step, steps_per_epoch)
        order = torch.from_numpy(np.random.default_rng([0, epoch]).permutation(len(x_train)))
        rows = order[batch * hp["batch_size"] : (batch + 1) * hp["batch_size"]]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
        loss.backward()
        optimizer.step()
        step += 1
        if stopping or step % every == 0:
            save_checkpoint(root, step, model, optimizer)
        if stopping:
            (root / "PREEMPTED").write_text(f"{step}\\n")  # what says "preempted" under torchrun
            print(f"preempted: saved a checkpoint at step {step}/{total}", flush=True)
            return EXIT_PREEMPTED
        if step % steps_per_epoch == 0:
            with torch.no_grad():
                accuracy = (model(torch.from_numpy(x_val)).argmax(1).numpy() == y_val).mean()
            metrics = {"val_accuracy": float(accuracy), "train_loss": loss.item()}
            print(f"step {step}/{total} {metrics}", flush=True)
            if tracking:
                mlflow.log_metrics(metrics, step=step)
            if progress:
                Path(progress).write_text(json.dumps({"step": step, "total_steps": total, "metrics": metrics}))

    import mlflow.pytorch

    served = nn.Sequential(model, nn.Softmax(dim=1)).eval()  # answers class probabilities
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"]
    example = x_val[:2]  # two rows: a one-row example would export a fixed batch size of 1
    write_atomically(
        root / "final",
        lambda tmp: mlflow.pytorch.save_model(served, str(tmp), input_example=example, pip_requirements=requirements),
    )
    if tracking:
        mlflow.end_run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

TORCH_REQUIREMENTS = """\
# What train.py needs (the Dockerfile takes torch from its base image; gpuferry adds its model server's packages).
torch>=2.4,<3
numpy>=1.26,<3
mlflow-skinny>=3.17,<4
"""

TORCH_DOCKERFILE = """\
# The workload's image: train.py and what it needs. gpuferry builds it (the context: this directory after
# .dockerignore), then adds its model server (runtime/) and checks that the server's packages are installed.
# BASE_IMAGE: an image with Python 3, pip and torch (built for its CUDA); a stack's image builder may set it.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The packages in a layer of their own: train.py's but torch (the base image's), and the model server's, whose
# list gpuferry puts in the build context as .gpuferry/runtime/requirements.txt.
COPY requirements.txt /tmp/requirements/workload.txt
COPY .gpuferry/runtime/requirements.txt /tmp/requirements/runtime.txt
RUN grep -v '^torch\\b' /tmp/requirements/workload.txt > /tmp/requirements/workload-without-torch.txt \\
    && python -m pip install --no-cache-dir -r /tmp/requirements/workload-without-torch.txt \\
       -r /tmp/requirements/runtime.txt \\
    && rm -rf /tmp/requirements

WORKDIR /workload
COPY . /workload
"""

TEMPLATES = ("sklearn", "pytorch")
# The bundled examples: examples/ of the checkout, a link in the package (deployments/examples).
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"


def examples() -> list[str]:
    """The names of the bundled examples."""
    return sorted(p.name for p in EXAMPLES_DIR.iterdir() if (p / "gpuferry.yaml").is_file())


def files(name: str, template: str = "sklearn") -> dict[str, str]:
    """The skeleton's files, by path relative to the workload's root."""
    if template not in TEMPLATES:
        from blocks.errors import ConfigurationError

        raise ConfigurationError(f"--template {template!r}: give one of {', '.join(TEMPLATES)}")
    if template == "pytorch":
        return {
            "gpuferry.yaml": TORCH_WORKLOAD_YAML.format(name=name),
            "train.py": TORCH_TRAIN_PY,
            "requirements.txt": TORCH_REQUIREMENTS,
            "Dockerfile": TORCH_DOCKERFILE,
            ".dockerignore": DOCKERIGNORE,
            ".gitignore": GITIGNORE,
        }
    return {
        "gpuferry.yaml": WORKLOAD_YAML.format(name=name),
        "train.py": TRAIN_PY,
        "requirements.txt": REQUIREMENTS,
        "Dockerfile": DOCKERFILE,
        ".dockerignore": DOCKERIGNORE,
        ".gitignore": GITIGNORE,
    }


def example_files(example: str, name: str | None = None) -> dict[str, str]:
    """The bundled example's files (its name replaced by ``name`` when given)."""
    from blocks.errors import ConfigurationError

    if example not in examples():
        raise ConfigurationError(f"--example {example!r}: give one of {', '.join(examples())}")
    root = EXAMPLES_DIR / example
    out = {
        p.relative_to(root).as_posix(): p.read_text()
        for p in sorted(root.iterdir())
        if p.is_file() and p.suffix != ".pyc"
    }
    if name is not None:
        out["gpuferry.yaml"] = re.sub(r"(?m)^name: .*$", f"name: {name}", out["gpuferry.yaml"], count=1)
    return out


def workload_name(directory: Path) -> str:
    """A valid workload name from the directory's name (lowercase letters, digits and '-')."""
    name = re.sub(r"[^a-z0-9-]+", "-", directory.resolve().name.lower()).strip("-")
    return name[:63] or "my-model"


def write(
    directory: Path,
    name: str | None = None,
    force: bool = False,
    template: str = "sklearn",
    example: str | None = None,
) -> list[Path]:
    """Write the skeleton (or the bundled ``example``) into ``directory``; the files written (an existing one is
    kept unless ``force``)."""
    from blocks.values import check_name

    if example is not None:
        wanted = example_files(example, check_name(name, "--name") if name else None)
    else:
        wanted = files(check_name(name or workload_name(directory), "--name"), template)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for relative, text in wanted.items():
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
    template: Annotated[
        str, typer.Option("--template", "-t", help="The skeleton: sklearn (scikit-learn's Ridge) or pytorch.")
    ] = "sklearn",
    example: Annotated[
        str | None, typer.Option("--example", "-e", help="Write a bundled example instead: digits or diabetes.")
    ] = None,
) -> None:
    """Write a workload skeleton (gpuferry.yaml, train.py, requirements.txt, Dockerfile) that passes `check` and
    runs."""
    written = write(directory, name, force, template, example)
    planned = example_files(example) if example is not None else files("x", template)
    kept = [p for p in planned if directory / p not in written]
    for path in written:
        typer.echo(f"wrote {path}")
    if kept:
        typer.echo(f"kept (exists; --force overwrites): {', '.join(kept)}")
    typer.echo(
        f"next: `gpuferry check STACK --workload {directory}`, then "
        f"`gpuferry run retrain --workload {directory} --stack STACK`"
    )
