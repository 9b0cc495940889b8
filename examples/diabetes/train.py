"""The regressor example: scikit-learn's ElasticNet on its diabetes data set (shipped with scikit-learn).

A training job in gpuferry's sense, importing nothing of gpuferry: it reads its settings from the
environment (gpuferry's contract), logs to MLflow when ``MLFLOW_TRACKING_URI`` is set, and saves the fitted
pipeline as an MLflow model (``mlflow.sklearn``, with a signature and an input example) in
``$CHECKPOINT_DIR/final/``. ``HPARAMS`` is a JSON object: ``alpha``, ``l1_ratio``, ``max_iter``,
``standardize`` (gpuferry checked them against ``gpuferry.yaml`` before the job started).

The fit takes well under a second, so the job keeps no intermediate checkpoints: stopped by SIGTERM or
SIGUSR1 before it finishes, it exits 75 (preempted) and a requeued job simply fits again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType

import numpy as np
from sklearn.datasets import load_diabetes
from sklearn.linear_model import ElasticNet
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

EXIT_PREEMPTED = 75
EXIT_USAGE = 2
DEFAULTS = {"alpha": 0.1, "l1_ratio": 0.5, "max_iter": 10_000, "standardize": True}
SPLIT_SEED = 0
stop_requested = False


def _stop(signum: int, frame: FrameType | None) -> None:
    global stop_requested
    stop_requested = True


def hyperparameters() -> dict:
    raw = json.loads(os.environ.get("HPARAMS") or "{}")
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {', '.join(unknown)}; valid: {', '.join(DEFAULTS)}")
    return {**DEFAULTS, **raw}


def write_progress(metrics: dict, step: int) -> None:
    path = os.environ.get("PROGRESS_FILE")
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps({"step": step, "total_steps": 1, "epoch": step, "metrics": metrics}))
        os.replace(tmp, path)


def save_model(target: Path, pipeline: object, example: object) -> None:
    """The fitted pipeline as an MLflow model at ``target``, written under a temporary name first."""
    import mlflow.sklearn
    import sklearn
    import skops
    from mlflow.models import infer_signature

    tmp = target.with_name(f".tmp-{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    signature = infer_signature(example, pipeline.predict(example))
    mlflow.sklearn.save_model(
        pipeline, str(tmp), signature=signature, input_example=example,
        pip_requirements=[f"scikit-learn=={sklearn.__version__}", f"numpy=={np.__version__}", f"skops=={skops.__version__}"],
    )
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGUSR1, _stop)
    try:
        hp = hyperparameters()
    except ValueError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    checkpoints = Path(os.environ.get("CHECKPOINT_DIR", "checkpoints"))
    checkpoints.mkdir(parents=True, exist_ok=True)

    data = load_diabetes(as_frame=True)
    x_train, x_val, y_train, y_val = train_test_split(data.data, data.target, test_size=0.2, random_state=SPLIT_SEED)
    steps = [StandardScaler()] if hp["standardize"] else []
    pipeline = make_pipeline(*steps, ElasticNet(alpha=hp["alpha"], l1_ratio=hp["l1_ratio"], max_iter=hp["max_iter"]))
    pipeline.fit(x_train, y_train)
    if stop_requested:
        print("preempted before the model was saved: exit 75 (a requeued job fits again)", flush=True)
        return EXIT_PREEMPTED

    predicted = pipeline.predict(x_val)
    metrics = {
        "val_rmse": float(np.sqrt(mean_squared_error(y_val, predicted))),
        "val_mae": float(mean_absolute_error(y_val, predicted)),
        "val_r2": float(r2_score(y_val, predicted)),
    }
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())), flush=True)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        with mlflow.start_run():  # MLFLOW_RUN_ID set: the pipeline's run
            mlflow.log_params(hp)
            mlflow.log_metrics(metrics)
    save_model(checkpoints / "final", pipeline, x_val.head(2))
    write_progress(metrics, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
