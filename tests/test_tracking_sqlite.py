"""The embedded SQLite MLflow store runs in write-ahead-log mode, which its file keeps."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from blocks.tracking.mlflow import MlflowTracking, sqlite_path


def _journal_mode(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        db.close()


def test_a_new_store_is_made_in_wal_mode_and_works(tmp_path: Path) -> None:
    path = tmp_path / "home" / "mlflow.db"
    tracking = MlflowTracking(tracking_uri=f"sqlite:///{path}", artifact_location=(tmp_path / "a").as_uri())
    experiment = tracking.experiment_id("wal")
    run_id = tracking.client.create_run(experiment, run_name="r", tags={"k": "v"}).info.run_id
    assert _journal_mode(path) == "wal"
    assert tracking.client.get_run(run_id).data.tags["k"] == "v"


def test_an_existing_store_is_switched_and_turning_it_off_leaves_the_file_alone(tmp_path: Path) -> None:
    kept, switched = tmp_path / "kept.db", tmp_path / "switched.db"
    for path in (kept, switched):
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE t (x)")
        db.commit()
        db.close()
        assert _journal_mode(path) == "delete"
    MlflowTracking(tracking_uri=f"sqlite:///{kept}", sqlite_wal=False).client.search_experiments()
    assert _journal_mode(kept) == "delete"
    MlflowTracking(tracking_uri=f"sqlite:///{switched}").client.search_experiments()
    assert _journal_mode(switched) == "wal"


def test_only_a_sqlite_file_uri_names_a_database() -> None:
    assert sqlite_path("sqlite:////abs/mlflow.db") == "/abs/mlflow.db"
    assert sqlite_path("sqlite:///rel.db?timeout=5") == "rel.db"
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("http://mlflow:5000") is None
    assert sqlite_path("postgresql://u@h/db") is None
