"""Log the hyperparameters the job received (HPARAMS, nested as declared) and a score; write no model."""

import json
import os

import mlflow

hp = json.loads(os.environ.get("HPARAMS") or "{}")
print(json.dumps(hp, sort_keys=True), flush=True)
with mlflow.start_run():
    mlflow.log_dict(hp, "hyperparameters.json")
    mlflow.log_metric("score", float(hp["optimizer"]["lr"]))
