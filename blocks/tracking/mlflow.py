"""MLflow tracking and model registry.

One MLflow run per pipeline run: params, metrics, tags (git sha, the backend of each step), the
checkpoint's URI and sha256. The model version points at the stored checkpoint (no second copy of
the weights) and the promotion alias moves only to a better version.

The embedded default is a SQLite store under ``$GPUFERRY_HOME``, in write-ahead-log mode (readers
do not block the writer, and a commit costs one write instead of a journal round trip: a sweep makes
its child runs several at a time); point ``tracking_uri`` at an MLflow server (``http://...``) for a
shared one.

A server that requires a login takes ``username`` + ``password`` (MLflow's basic auth) or ``token`` (a bearer
token). This process's client sends them without putting them in its environment (``blocks/tracking/client.py``);
a training job that logs to the server gets them as ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` or
``MLFLOW_TRACKING_TOKEN`` through its backend's secret file (``job_secrets``), never in its script or argv.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, model_validator

from blocks.checks import CheckRow, Probe
from blocks.home import gpuferry_home
from blocks.records import CheckpointRef
from blocks.tracking.uris import is_server

logger = logging.getLogger(__name__)


def _default_tracking_uri() -> str:
    return f"sqlite:///{gpuferry_home() / 'mlflow.db'}"


def _default_artifacts() -> str:
    return (gpuferry_home() / "mlartifacts").as_uri()


class MlflowTracking(Block):
    """An MLflow tracking server (or local store) and its model registry."""

    _block_type_name = "gpuferry MLflow Tracking"
    _description = "MLflow tracking URI, registry and experiment settings used by the pipeline."
    # A refused value is not repeated in the error: it may be the password.
    model_config = ConfigDict(hide_input_in_errors=True)

    tracking_uri: str = Field(default_factory=_default_tracking_uri, description="MLflow tracking URI.")
    registry_uri: str | None = Field(None, description="Model registry URI (None: the tracking URI).")
    artifact_location: str | None = Field(
        None,
        description="Artifact root for new experiments (None: the server's default for an http(s) tracking URI, "
        "mlartifacts under $GPUFERRY_HOME for a local store).",
    )
    ui_url: str | None = Field(
        None,
        description="Base URL of the MLflow UI for links (None: the tracking URI when it is http(s)).",
    )
    http_max_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="MLflow's own retries of one HTTP request (MLFLOW_HTTP_REQUEST_MAX_RETRIES; MLflow's default 7 "
        "spends minutes on a server that is down). The pipeline's task retries come on top.",
    )
    http_timeout_seconds: int = Field(
        30,
        ge=1,
        le=600,
        description="Timeout of one HTTP request to the tracking server (MLFLOW_HTTP_REQUEST_TIMEOUT).",
    )

    username: str | None = Field(
        None,
        description="User of an MLflow server with basic auth (`mlflow server --app-name basic-auth`), with "
        "password; not with token. Training jobs get it as MLFLOW_TRACKING_USERNAME through their secret file.",
    )
    password: SecretStr | None = Field(
        None,
        description="Password of username (basic auth). Training jobs get it as MLFLOW_TRACKING_PASSWORD "
        "through their secret file, never in a script, command line or log.",
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token of an MLflow server behind a token login (instead of username + password). "
        "Training jobs get it as MLFLOW_TRACKING_TOKEN through their secret file.",
    )

    sqlite_wal: bool = Field(
        True,
        description="For a local SQLite store (sqlite:///...): switch the database file to write-ahead-log mode "
        "(which the file keeps). Turn off when the file is on a network filesystem, where SQLite's WAL does not work.",
    )

    @model_validator(mode="after")
    def _one_login(self) -> MlflowTracking:
        basic = self.username is not None or self.password is not None
        if basic and self.token is not None:
            raise ValueError("tracking: give username + password (basic auth) or token (a bearer token), not both")
        if basic and not (self.username and self.password and self.password.get_secret_value()):
            raise ValueError("tracking.username and tracking.password go together (basic auth): set both, or neither")
        if (basic or self.token is not None) and not (is_server(self.tracking_uri) or is_server(self.registry_uri)):
            raise ValueError(
                f"tracking.username / password / token log in to an MLflow server, but tracking_uri="
                f"{self.tracking_uri!r} is a local store: point tracking_uri at the server (http(s)://...) or "
                "remove the credentials"
            )
        return self

    def job_secrets(self) -> dict[str, SecretStr]:
        """The variables a training job that logs to the server needs to log in (empty: no login)."""
        if self.token is not None:
            return {"MLFLOW_TRACKING_TOKEN": self.token}
        if self.username and self.password is not None:
            return {"MLFLOW_TRACKING_USERNAME": SecretStr(self.username), "MLFLOW_TRACKING_PASSWORD": self.password}
        return {}

    def host_creds(self, uri: str) -> Any:
        """MLflow's settings of a request to ``uri`` from the environment, the block's login instead of the
        environment's when it has one."""
        from mlflow.utils.credentials import get_default_host_creds

        creds = get_default_host_creds(uri)
        if self.token is not None:
            creds.username, creds.password, creds.token = None, None, self.token.get_secret_value()
        elif self.username and self.password is not None:
            creds.username, creds.password, creds.token = self.username, self.password.get_secret_value(), None
        return creds

    def _refusal(self, status: int, uri: str, reason: str) -> str:
        given = (
            "tracking.token"
            if self.token is not None
            else f"tracking.username={self.username!r} and its password"
            if self.username
            else None
        )
        if status == 403:
            return (
                f"the MLflow server {uri} refused the request (HTTP 403: {reason.strip()[:200]}): the account of "
                f"{given or 'the anonymous user'} lacks the permission; grant it on the server, or set "
                "tracking.username + tracking.password (or tracking.token) to an account that has it"
            )
        if given is None:
            return (
                f"the MLflow server {uri} requires a login (HTTP 401) and the tracking block has none: set "
                "tracking.username + tracking.password (basic auth) or tracking.token"
            )
        return (
            f"the MLflow server {uri} refused the login of {given} (HTTP 401): fix tracking.username + "
            "tracking.password (basic auth) or tracking.token"
        )

    @cached_property
    def client(self) -> Any:
        from blocks.tracking.client import client_with_credentials

        if self.sqlite_wal:
            path = sqlite_path(self.tracking_uri)
            if path is not None:
                enable_wal(path)

        # MLflow reads these from the environment on every request; a value set there explicitly wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.http_max_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(self.http_timeout_seconds))
        return client_with_credentials(
            self.tracking_uri, self.registry_uri or self.tracking_uri, self.host_creds, self._refusal
        )

    @property
    def concurrent_writes(self) -> int:
        """How many runs to create at once: 8 against a tracking server (requests overlap their
        round trips), 1 against a local database (SQLite lets one writer in at a time, and the store's
        work is Python under one lock: 1000 runs took 6.5–6.9 s with 1 thread, 7.9–8.9 s with 2)."""
        return 1 if self.tracking_uri.startswith(("sqlite:", "file:")) or "://" not in self.tracking_uri else 8

    # ---- runs ----

    def experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self._artifact_location())
        except Exception:
            # Another run created it in between.
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _artifact_location(self) -> str | None:
        if self.artifact_location is not None or is_server(self.tracking_uri):
            return self.artifact_location  # a server's experiments default to its own artifact store
        return _default_artifacts()

    def start_run(self, experiment: str, run_name: str, tags: dict[str, str]) -> str:
        """Create the pipeline's run, or return the one already created for this flow run
        (``tags['prefect.flow_run_id']``)."""
        exp = self.experiment_id(experiment)
        flow_run_id = tags.get("prefect.flow_run_id")
        if flow_run_id:
            found = self.client.search_runs([exp], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
            if found:
                return found[0].info.run_id
        return self.client.create_run(exp, run_name=run_name, tags=tags).info.run_id

    def log(
        self,
        run_id: str,
        *,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = _now_ms()
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def run_metrics(self, run_id: str) -> dict[str, float]:
        return dict(self.client.get_run(run_id).data.metrics)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def run_url(self, run_id: str) -> str:
        base = self.ui_url or (self.tracking_uri if is_server(self.tracking_uri) else None)
        run = self.client.get_run(run_id)
        if base:
            return f"{base.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
        return (
            f"mlflow ui --backend-store-uri {self.tracking_uri}  →  experiment {run.info.experiment_id}, run {run_id}"
        )

    # ---- registry ----

    def register(
        self,
        model_name: str,
        run_id: str,
        checkpoint: CheckpointRef,
        metric: str,
        value: float,
        tags: dict[str, str] | None = None,
    ) -> str:
        """A new version of ``model_name`` whose source is the stored checkpoint (an MLflow model with its
        manifest); idempotent per run. ``tags`` go on the version too (how it is served, which code made it)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(model_name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        for existing in self.client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'"):
            if existing.source == checkpoint.uri:
                return str(existing.version)
        version = self.client.create_model_version(
            model_name,
            source=checkpoint.uri,
            run_id=run_id,
            tags={
                **(tags or {}),
                "checkpoint_uri": checkpoint.uri,
                "checkpoint_sha256": checkpoint.sha256,
                "checkpoint_size_bytes": str(checkpoint.size_bytes),
                metric: repr(value),
            },
        )
        return str(version.version)

    def version_metric(self, model_name: str, version: str, metric: str) -> float | None:
        mv = self.client.get_model_version(model_name, version)
        if metric in mv.tags:
            return float(mv.tags[metric])
        if mv.run_id:
            return self.client.get_run(mv.run_id).data.metrics.get(metric)
        return None

    def version_by_alias(self, model_name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(model_name, alias).version)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(model_name, alias, version)

    def model_source(self, model_name: str, version: str) -> str:
        return self.client.get_model_version(model_name, version).source

    def registered_tag_values(self, key: str) -> set[str]:
        """The values of tag ``key`` on every version of every registered model (the images versions were
        trained in, for ``gpuferry gc``)."""
        return {v.tags[key] for v in self._every_version() if (v.tags or {}).get(key)}

    def recent_run_tag_values(self, key: str, since: float) -> set[str]:
        """The values of tag ``key`` on every run of every experiment started at or after ``since`` (epoch
        seconds): what runs still in flight, or lately ended, used."""
        from mlflow.entities import ViewType

        experiments = [e.experiment_id for e in self.client.search_experiments(view_type=ViewType.ALL)]
        values: set[str] = set()
        for start in range(0, len(experiments), 100):  # MLflow takes at most 100 experiments per search
            token = None
            while True:
                page = self.client.search_runs(
                    experiments[start : start + 100],
                    filter_string=f"attributes.start_time >= {int(since * 1000)}",
                    run_view_type=ViewType.ALL,
                    max_results=1000,
                    page_token=token,
                )
                values.update(r.data.tags[key] for r in page if r.data.tags.get(key))
                token = page.token
                if not token:
                    break
        return values

    def registered_sources(self) -> set[str]:
        """The checkpoint URI of every version of every registered model (what ``gpuferry gc`` never frees),
        without a trailing slash."""
        return {str(v.source).rstrip("/") for v in self._every_version() if v.source}

    def _every_version(self) -> Iterator[Any]:
        """Every version of every registered model, the registry's pages read to the end."""
        token = None
        while True:
            page = self.client.search_model_versions(max_results=1000, page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def version_tags(self, model_name: str, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(model_name, version).tags)

    def tag_version(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(model_name, version, key, value)

    def record_deploy(
        self, model_name: str, version: str, tags: dict[str, str], prefix: str, runs: Iterable[str] = ()
    ) -> list[str]:
        """Set ``tags`` (a deploy's outcome) on the model version, on its source run and on ``runs``.

        Tags under ``prefix`` that ``tags`` does not set are removed, so that an earlier outcome's
        fields (an old rollback's reason) do not linger next to a newer one. Returns the runs tagged.
        """
        mv = self.client.get_model_version(model_name, version)
        stale = [k for k in mv.tags if k.startswith(prefix) and k not in tags]
        for key in stale:
            self.client.delete_model_version_tag(model_name, version, key)
        self.tag_version(model_name, version, tags)
        run_ids = list(dict.fromkeys([*([mv.run_id] if mv.run_id else []), *runs]))
        for run_id in run_ids:
            for key in [k for k in self.client.get_run(run_id).data.tags if k.startswith(prefix) and k not in tags]:
                self.client.delete_tag(run_id, key)
            self.log(run_id, tags=tags)
        return run_ids

    def resolve_version(self, model_name: str, version: str | None = None, alias: str | None = None) -> tuple[str, str]:
        """``(version, source)`` of ``model_name``: ``version`` itself, else the version ``alias`` points at.

        Raises ``ConfigurationError`` naming the field when the model, version or alias does not exist.
        """
        from mlflow.exceptions import MlflowException

        from blocks.errors import ConfigurationError

        if not version and not alias:
            raise ConfigurationError("give a version or an alias of the model (both are empty)")
        if not version:
            assert alias  # one of the two was given
            version = self.version_by_alias(model_name, alias)
            if version is None:
                raise ConfigurationError(
                    f"alias={alias!r}: model {model_name!r} has no such alias in {self.tracking_uri}; "
                    "set it in the registry or pass version="
                )
        try:
            mv = self.client.get_model_version(model_name, str(version))
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise ConfigurationError(
                    f"version={version!r}: model {model_name!r} has no such version in {self.tracking_uri}"
                ) from exc
            raise
        return str(mv.version), mv.source

    def aliases(self, model_name: str) -> dict[str, str]:
        """Every alias of ``model_name`` → the version it points at (empty when the model does not exist)."""
        from mlflow.exceptions import MlflowException

        try:
            return {alias: str(v) for alias, v in self.client.get_registered_model(model_name).aliases.items()}
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return {}
            raise

    def alias_map(self) -> dict[str, dict[str, str]]:
        """Every registered model → its aliases → the version each points at (one paged search)."""
        out: dict[str, dict[str, str]] = {}
        token = None
        while True:
            page = self.client.search_registered_models(max_results=1000, page_token=token)
            for model in page:
                out[model.name] = {alias: str(v) for alias, v in (model.aliases or {}).items()}
            token = page.token
            if not token:
                return out

    # ---- checks ----

    def self_check(self, probe: Probe) -> list[CheckRow]:
        """The server and its version, the tracking and registry APIs, webhooks (``blocks/checks.py``)."""
        from blocks.tracking.check import check_mlflow

        check_mlflow(self, probe)
        return probe.rows


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI (None for any other URI or an in-memory database)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return path if path and path != ":memory:" else None


def enable_wal(path: str) -> bool:
    """Put the SQLite database ``path`` (created if missing) in write-ahead-log mode; True when it is.

    The mode is kept in the file, so this runs once per client and costs nothing once set. A database
    another process holds locked meanwhile stays as it is (logged): WAL is a speed-up, not a need.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as db:
            mode = db.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal":
                mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.Error as exc:
        logger.warning("could not switch the MLflow store %s to write-ahead-log mode: %s", path, exc)
        return False
    if mode != "wal":
        logger.warning("the MLflow store %s stays in %s journal mode (its filesystem has no WAL support)", path, mode)
    return mode == "wal"


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
