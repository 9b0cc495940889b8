"""A trained model stored from the cluster that wrote it, when this machine cannot see the cluster's filesystem.

The job writes its MLflow model to ``CHECKPOINT_DIR/final/`` on the cluster's shared filesystem. Instead of
reading it from there, the orchestrator has the cluster store it (``python -m runtime.store`` on the login node,
over SSH): gpuferry's ``runtime`` package goes to the cluster once per content (like the workload's code), the
store's settings and credentials go in a 0600 file the command's shell sources (never on a command line), the
CA certificate of a store with a private CA in a 0600 file beside it, and both files are removed when the
command ends. The command checks the model, stores it with the same code as the orchestrator's S3 store, and
prints what it stored: the checkpoint's URI and sha256 come back, the bytes never do.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import uuid
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import runtime
from blocks.base.mlflow_model import ModelInfo, NoModel
from blocks.base.storage import CheckpointStore
from blocks.errors import ChecksumMismatch, ConfigurationError, GpuferryError, TransientError
from blocks.records import CheckpointRef, CodeRef


class Cluster(Protocol):
    """What storing from the cluster needs of the ``SlurmCluster`` block: its interpreters and store timeout, its
    commands, its shipped code and its private files."""

    python: str
    store_python: str | None
    store_timeout_seconds: float

    def run(self, argv: Sequence[str], *, check: bool = ..., timeout: float | None = ...) -> tuple[int, str, str]: ...

    def code_dir(self, sha256: str) -> str: ...

    def ship_archive(self, code: CodeRef, target: str, what: str) -> str: ...

    def write_private(self, path: str, data: bytes) -> None: ...


RUNTIME_DIR = Path(runtime.__file__).resolve().parent
_ERRORS: dict[str, type[GpuferryError]] = {
    "no_model": NoModel,
    "configuration": ConfigurationError,
    "transient": TransientError,
    "mismatch": ChecksumMismatch,
}


@lru_cache(maxsize=1)
def runtime_code() -> CodeRef:
    """gpuferry's ``runtime`` package as one content-addressed archive."""
    from blocks.workload.source import code_archive, workload_files

    # Installed, it is in no repository: every file of it.
    return code_archive(RUNTIME_DIR, workload_files(RUNTIME_DIR, use_git=False))


def _runtime_on(cluster: Cluster) -> str:
    """The directory on the cluster whose ``runtime/`` is this gpuferry's (its PYTHONPATH entry)."""
    code = runtime_code()
    parent = cluster.code_dir(f"runtime-{code.sha256}")
    cluster.ship_archive(code, posixpath.join(parent, "runtime"), "gpuferry's runtime")
    return parent


def _answer(rc: int, out: str, err: str, what: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        detail = (err or out).strip()[-2000:] or f"exit code {rc}"
        hint = (
            " (is the cluster's python the one with gpuferry's runtime dependencies: PyYAML, boto3?)"
            if "ModuleNotFoundError" in detail
            else ""
        )
        raise GpuferryError(f"{what} on the cluster gave no answer{hint}:\n{detail}")
    if not answer.get("ok"):
        raise _ERRORS.get(str(answer.get("kind")), GpuferryError)(f"{what} on the cluster: {answer.get('message')}")
    return answer


def inspect_remote(cluster: Cluster, final_dir: str) -> ModelInfo:
    """The MLflow model at ``final_dir`` on the cluster."""
    path = _runtime_on(cluster)
    rc, out, err = cluster.run(
        [
            "env",
            f"PYTHONPATH={path}",
            cluster.store_python or cluster.python,
            "-m",
            "runtime.store",
            final_dir,
            "--check",
        ],
        check=False,
    )
    return ModelInfo(**_answer(rc, out, err, f"reading the MLflow model in {final_dir}")["model"])


# Source the 0600 settings file ($1) into the environment, delete it and the CA file ($2), then run the rest.
_WITH_SECRETS_SH = (
    'set -a; . "$1" || exit 90; set +a; rm -f -- "$1"; file=$2; shift 2; "$@"; rc=$?; rm -f -- "$file"; exit $rc'
)


def store_remote(cluster: Cluster, final_dir: str, store: CheckpointStore, name: str) -> CheckpointRef:
    """Have the cluster store the model at ``final_dir`` as checkpoint ``name`` of ``store``."""
    destination = store.remote_destination(name)
    path = _runtime_on(cluster)
    where = posixpath.dirname(final_dir.rstrip("/"))  # the job's own directory: private to its user
    token = uuid.uuid4().hex[:12]
    settings_file = posixpath.join(where, f".store-{token}.env")
    ca_file = posixpath.join(where, f".store-{token}-ca.pem")
    env = {**destination.env, **destination.secrets}
    if destination.ca_bundle is not None:
        cluster.write_private(ca_file, destination.ca_bundle)
        env["AWS_CA_BUNDLE"] = ca_file
    cluster.write_private(settings_file, "".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted(env.items())).encode())
    argv = [
        "sh",
        "-c",
        _WITH_SECRETS_SH,
        "sh",
        settings_file,
        ca_file,
        "env",
        f"PYTHONPATH={path}",
        cluster.store_python or cluster.python,
        "-m",
        "runtime.store",
        final_dir,
        "--to",
        destination.uri,
        *destination.args,
    ]
    try:
        rc, out, err = cluster.run(argv, check=False, timeout=cluster.store_timeout_seconds)
    finally:
        cluster.run(["rm", "-f", "--", settings_file, ca_file], check=False)
    answer = _answer(rc, out, err, f"storing {final_dir} as {destination.uri}")
    return CheckpointRef(
        uri=answer["uri"],
        sha256=answer["sha256"],
        size_bytes=answer["size_bytes"],
        files=answer["files"],
        bytes_uploaded=answer["bytes_uploaded"],
    )
