"""``python -m runtime.store DIR --to s3://bucket/prefix``: store a trained model from where it was written.

(``--check`` only reads the MLflow model in ``DIR`` and answers ``{"ok": true, "model": {...}}``.)

A training cluster whose filesystem the orchestrator cannot see runs this next to the checkpoint (gpuferry runs it
on the cluster's login node, over SSH): it checks that ``DIR`` holds an MLflow model, stores it with
``runtime.s3_upload`` (the same requests and checks as the orchestrator's S3 store: the manifest last, unchanged
files not sent again, an interrupted upload resumed), and prints one JSON line saying what it stored, or why not:

    {"ok": true, "uri": "s3://...", "sha256": "...", "size_bytes": N, "files": N, "bytes_uploaded": N,
     "model": {"flavors": [...], "pyfunc": true, "signature": true, "serving_example": "serving_input_example.json"}}
    {"ok": false, "kind": "no_model" | "configuration" | "transient" | "mismatch" | "error", "message": "..."}

The exit code is 0 or 1 accordingly. Credentials come from the environment only (boto3's own variables:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``,
``AWS_CA_BUNDLE``), which gpuferry sources from a 0600 file: never a command line. The hash cache and the record
of unfinished uploads live under ``$GPUFERRY_HOME/cache`` (default ``~/.cache/gpuferry``) on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

if __package__ in (None, ""):  # run as a script: the directory above runtime/ on the path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from runtime import mlmodel, s3_upload
from runtime.manifest import EmptyCheckpoint, HashCache, default_cache_root
from runtime.s3_errors import explain, no_retry_of_tls_refusals


def s3_client(max_pool_connections: int) -> Any:
    """boto3's client from the environment, configured as gpuferry's S3 store configures its own: every body
    signed with its sha256, no botocore CRC32 trailer (Ceph RGW 16 refuses it over https), TLS refusals not
    retried."""
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max_pool_connections,
        request_checksum_calculation="when_required",
        s3={"payload_signing_enabled": True},
    )
    client = boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        verify=os.environ.get("AWS_CA_BUNDLE") or None,
        config=config,
    )
    client.meta.events.register_first("needs-retry.s3", no_retry_of_tls_refusals)
    return client


def store(source: Path, destination: str, settings: s3_upload.UploadSettings) -> dict[str, Any]:
    """Check and store ``source``; the answer printed (see the module's docstring)."""
    try:
        model = mlmodel.read_model(source)
    except mlmodel.NoModel as exc:
        return {"ok": False, "kind": "no_model", "message": str(exc)}
    parsed = urlparse(destination)
    if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
        return {"ok": False, "kind": "configuration", "message": f"--to {destination!r}: give s3://bucket/prefix"}
    bucket, root = parsed.netloc, parsed.path.strip("/")
    try:
        import boto3  # noqa: F401 - the one package this needs besides PyYAML
    except ImportError:
        return {
            "ok": False,
            "kind": "configuration",
            "message": f"{sys.executable} has no boto3: install it where "
            "the checkpoint is written (pip install boto3), or set the cluster block's python to one that has it",
        }
    client = s3_client(settings.max_concurrency + settings.max_parallel_files + 2)
    cache = HashCache(default_cache_root() / "sha256")
    journal = s3_upload.UploadJournal(client.meta.endpoint_url, bucket, default_cache_root() / "s3-uploads")
    try:
        raw, manifest, moved = s3_upload.put_directory(
            client, bucket, root, source, settings, cache=cache, journal=journal
        )
    except s3_upload.StoredMismatch as exc:
        return {"ok": False, "kind": "mismatch", "message": str(exc)}
    except EmptyCheckpoint as exc:
        return {"ok": False, "kind": "no_model", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which decides about retrying
        meaning = explain(exc, f"s3://{bucket}/{root}")
        kind, message = meaning if meaning else ("error", f"{type(exc).__name__}: {exc}")
        if meaning is None and type(exc).__name__ in (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
        ):
            kind = "transient"
        return {"ok": False, "kind": kind, "message": message}
    return {
        "ok": True,
        "uri": f"s3://{bucket}/{root}",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "size_bytes": sum(e["size"] for e in manifest["files"]),
        "files": len(manifest["files"]),
        "bytes_uploaded": moved,
        "model": model,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the directory the training job wrote (CHECKPOINT_DIR/final)")
    parser.add_argument("--to", help="s3://bucket/prefix of the stored checkpoint")
    parser.add_argument("--check", action="store_true", help="only read the MLflow model and say what it is")
    parser.add_argument("--multipart-threshold", type=int, default=s3_upload.UploadSettings.multipart_threshold)
    parser.add_argument("--part-size", type=int, default=s3_upload.UploadSettings.part_size)
    parser.add_argument("--max-concurrency", type=int, default=s3_upload.UploadSettings.max_concurrency)
    parser.add_argument("--max-parallel-files", type=int, default=s3_upload.UploadSettings.max_parallel_files)
    args = parser.parse_args(argv)
    settings = s3_upload.UploadSettings(
        multipart_threshold=args.multipart_threshold,
        part_size=args.part_size,
        max_concurrency=args.max_concurrency,
        max_parallel_files=args.max_parallel_files,
    )
    if args.check:
        try:
            answer: dict[str, Any] = {"ok": True, "model": mlmodel.read_model(args.source)}
        except mlmodel.NoModel as exc:
            answer = {"ok": False, "kind": "no_model", "message": str(exc)}
    elif not args.to:
        parser.error("give --to s3://bucket/prefix (or --check)")
    else:
        answer = store(args.source, args.to, settings)
    print(json.dumps(answer), flush=True)
    return 0 if answer["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
