"""MLflow tracking and model registry (``MlflowTracking``): ``mlflow`` is the block, ``client`` an MLflow client
with credentials of its own, ``check`` what ``gpuferry check`` asks.
"""
