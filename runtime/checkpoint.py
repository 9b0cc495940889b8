"""Fetch a stored checkpoint into a local directory, every file checked against its manifest.

Model-agnostic: it imports only the standard library and ``runtime.contract`` (and boto3, for ``s3://`` only), so a
workload's own server can use it without MLflow::

    from runtime.checkpoint import UnverifiedCheckpoint, fetch_checkpoint

    checkpoint = fetch_checkpoint(os.environ["MODEL_URI"], "/tmp/model")  # raises when it cannot be trusted
    load_my_model(checkpoint.path)

A checkpoint is a directory that holds ``MANIFEST.json`` (format in ``runtime/contract.py``), written last by
gpuferry's checkpoint stores. Only the files it lists are fetched, each hashed as it is copied (one read) and
renamed into place only when its size and sha256 match; the manifest itself lands last. Files are copied even
from a local path, so what is loaded is exactly what was checked, whatever happens to the stored copy later.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

from runtime import contract

_CHUNK = 1 << 20


class UnverifiedCheckpoint(Exception):
    """The checkpoint has no manifest, or a file that does not match it: it must not be served."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    path: Path  # the local directory holding the verified files (and a copy of the manifest)
    sha256: str  # of MANIFEST.json: the checkpoint's identity, as gpuferry records it in MLflow
    files: int
    size_bytes: int


def fetch_checkpoint(uri: str, dest: str | Path, expected_sha256: str | None = None) -> VerifiedCheckpoint:
    """Copy the checkpoint at ``uri`` (a path, ``file:///path`` or ``s3://bucket/prefix``) into ``dest``.

    ``expected_sha256``: the checkpoint's identity as the model version records it (``MODEL_SHA256``); a
    checkpoint whose manifest has another is refused before any file is fetched (it was replaced since).

    Raises ``UnverifiedCheckpoint`` when it has no manifest or a listed file is missing or differs from it,
    ``contract.ManifestError`` when the manifest is not one, ``FileNotFoundError`` when nothing is at ``uri``
    and ``ValueError`` for a URI of another kind. ``dest`` is created; files already in it are replaced.
    """
    parsed = urlparse(uri)
    target = Path(dest)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{uri}: an s3:// URI names a bucket (s3://bucket/prefix)")
        return _fetch_s3(parsed.netloc, parsed.path.strip("/"), target, expected_sha256)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: file:// URIs must name a local path (file:///path)")
        root = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        root = Path(uri)
    else:
        raise ValueError(f"{uri}: unsupported scheme {parsed.scheme!r} (use a path, file:// or s3://)")
    if root.is_file():
        raise ValueError(f"{uri} is a file: name the checkpoint directory, which holds {contract.MANIFEST_FILENAME}")
    if not root.is_dir():
        raise FileNotFoundError(f"{uri}: no checkpoint directory at {root}")
    try:
        raw = (root / contract.MANIFEST_FILENAME).read_bytes()
    except FileNotFoundError:
        raise UnverifiedCheckpoint(_no_manifest(root)) from None
    _check_identity(raw, expected_sha256, str(root))
    files = contract.parse_manifest(raw, str(root))["files"]
    for entry in files:
        where = f"{root}/{entry['path']}"
        try:
            source = open(root / entry["path"], "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
        with source:
            _copy_checked(source, entry, target, where)
    return _finish(raw, files, target)


def _check_identity(raw: bytes, expected: str | None, where: str) -> None:
    actual = hashlib.sha256(raw).hexdigest()
    if expected and actual != expected:
        raise UnverifiedCheckpoint(
            f"{where}: its {contract.MANIFEST_FILENAME} has sha256 {actual}, but the model version records {expected}: "
            "the stored checkpoint is not the one that was registered; refusing to serve it"
        )


def _fetch_s3(bucket: str, prefix: str, target: Path, expected_sha256: str | None = None) -> VerifiedCheckpoint:
    """The S3 side: one plain GET per listed file, hashed as it streams (ranged GETs are slow on some servers)."""
    client = s3_client()
    base = f"{prefix}/" if prefix else ""
    root = f"s3://{bucket}/{prefix}".rstrip("/")
    try:
        raw = client.get_object(Bucket=bucket, Key=f"{base}{contract.MANIFEST_FILENAME}")["Body"].read()
    except client.exceptions.NoSuchKey:
        raise UnverifiedCheckpoint(_no_manifest(root)) from None
    _check_identity(raw, expected_sha256, root)
    files = contract.parse_manifest(raw, root)["files"]
    for entry in files:
        where = f"s3://{bucket}/{base}{entry['path']}"
        try:
            body = client.get_object(Bucket=bucket, Key=f"{base}{entry['path']}")["Body"]
        except client.exceptions.NoSuchKey:
            raise UnverifiedCheckpoint(f"{where}: listed in {contract.MANIFEST_FILENAME} but missing") from None
        try:
            _copy_checked(body, entry, target, where)
        finally:
            body.close()
    return _finish(raw, files, target)


def s3_client() -> Any:
    """A boto3 S3 client from the environment: the usual credential variables, ``AWS_ENDPOINT_URL`` (an
    S3-compatible server) and ``AWS_CA_BUNDLE`` (its CA over https)."""
    import boto3  # only s3:// URIs need it

    # boto3 reads both variables itself in recent releases; passing them keeps older ones on the same endpoint.
    return boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
        verify=os.environ.get("AWS_CA_BUNDLE") or None,
    )


def _copy_checked(source: BinaryIO, entry: dict[str, Any], target: Path, where: str) -> None:
    """Copy ``source`` to ``target/<path>`` through a temporary name, renamed only when size and sha256 match."""
    dest = target / entry["path"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
            raise UnverifiedCheckpoint(
                f"{where}: sha256 {digest.hexdigest()} ({size} bytes) but {contract.MANIFEST_FILENAME} says "
                f"{entry['sha256']} ({entry['size']} bytes): the checkpoint is corrupt or incomplete; "
                "refusing to serve it"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _finish(raw: bytes, files: list[dict[str, Any]], target: Path) -> VerifiedCheckpoint:
    target.mkdir(parents=True, exist_ok=True)
    (target / contract.MANIFEST_FILENAME).write_bytes(raw)
    return VerifiedCheckpoint(target, hashlib.sha256(raw).hexdigest(), len(files), sum(e["size"] for e in files))


def _no_manifest(where: object) -> str:
    return (
        f"{where} has no {contract.MANIFEST_FILENAME}: refusing to serve a checkpoint that cannot be verified "
        "(store it with a gpuferry checkpoint store, which writes the manifest last)"
    )
