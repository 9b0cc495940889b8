"""Store the trained checkpoint."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from blocks.specs import CheckpointRef
from blocks.storage import CheckpointStore
from tasks.retry import retry_options


@task(name="upload-checkpoint", **retry_options(retries=4))
def upload_checkpoint(store: CheckpointStore, local_dir: str, name: str) -> CheckpointRef:
    """Store the directory with its manifest; an unchanged file is not sent again, so a retry resumes."""
    ref = store.put(Path(local_dir), name)
    get_run_logger().info(
        "checkpoint %s: %d files, %d bytes (%d moved), sha256 %s",
        ref.uri, ref.files, ref.size_bytes, ref.bytes_uploaded, ref.sha256,
    )
    return ref
