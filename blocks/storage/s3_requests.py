"""The request-level parts of ``S3CheckpointStore`` (``blocks/storage/s3.py``) on the orchestrator: S3's errors as
the blocks' errors, and where this machine records its unfinished multipart uploads. The upload itself is
``runtime/s3_upload.py``, which a cluster runs too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blocks.errors import ConfigurationError, TransientError
from blocks.home import gpuferry_home
from runtime import s3_upload
from runtime.s3_errors import error_code, explain, no_retry_of_tls_refusals, tls_refusal  # noqa: F401 - re-exported


class explained:  # noqa: N801 - a context manager read as a phrase: `with explained(bucket, key):`
    """Errors of the store that no retry mends (no bucket, bad credentials, an untrusted TLS certificate) become
    ConfigurationError, naming the field to fix; everything else propagates as the client raised it."""

    def __init__(self, bucket: str, key: str) -> None:
        self.where = f"s3://{bucket}/{key}"

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        meaning = explain(exc, self.where) if exc is not None else None
        if meaning is None:
            return
        kind, message = meaning
        if kind == "configuration":
            raise ConfigurationError(message) from exc
        raise TransientError(message) from getattr(exc, "last_exception", None) or exc


class UploadJournal(s3_upload.UploadJournal):
    """``runtime.s3_upload.UploadJournal`` under ``$GPUFERRY_HOME/cache/s3-uploads`` by default."""

    def __init__(self, endpoint: str, bucket: str, root: Path | None = None) -> None:
        super().__init__(endpoint, bucket, root if root is not None else gpuferry_home() / "cache" / "s3-uploads")
