"""What ``gpuferry gc`` frees: what nothing uses any more, and only that.

* **Stored checkpoints** of the stack's store that no version of any registered model in the stack's MLflow has as
  its source (a version's checkpoint is never freed, whatever its age or stage), stored longer ago than the limit
  (a checkpoint stored by a run that has not registered it yet is young).
* **Job directories** of jobs and sweep arrays that ended, on backends whose job directories this machine sees
  (``LocalProcesses``, ``DockerCompute``: ``ComputeBackend.ended_jobs``), last written longer ago than the limit; a
  directory that holds a registered version's source is kept.
* **Code archives** in ``$GPUFERRY_CACHE/code`` unused for longer than the limit (each run's archive is made
  again from the workload when it is needed).
* On a Slurm cluster (``blocks/slurm/housekeeping.py``), over the block's connection: the job directories no
  queued job carries and the code directories no queued job runs in, last written (or used) longer ago than
  the limit.
* **Images** of the stack's image builder's repository (``ImageBuilder.stored_images``: a registry's, one per
  digest) that no registered version was trained in and no training run started within the limit uses (a run
  tags its MLflow run with its image when it starts, so a run in flight keeps its image), built longer ago than
  the limit. A content tag deleted is built again when a workload needs it.

``garbage`` lists them (a dry run: nothing is touched), ``collect`` frees what it is given.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

from blocks.home import gpuferry_cache
from blocks.records import IMAGE_TAG, RUN_IMAGE_TAG, Garbage
from blocks.stack import Stack

DAY = 86400.0


def _local(uri: str) -> str | None:
    """The path of a file:// or plain-path URI (None for another scheme)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return str(Path(parsed.path or uri).resolve())
    return None


def garbage(blocks: Stack, older_than_days: float, now: float | None = None) -> list[Garbage]:
    """What nothing uses and is older than ``older_than_days``, oldest first (see the module's docstring)."""
    cutoff = (time.time() if now is None else now) - older_than_days * DAY
    referenced = blocks.tracking.registered_sources()
    referenced_paths = [p for p in (_local(s) for s in referenced) if p]
    found = [c for c in blocks.storage.stored() if c.where.rstrip("/") not in referenced and c.modified < cutoff]
    for job in blocks.compute.ended_jobs():
        holds_a_version = any(Path(p).is_relative_to(Path(job.where).resolve()) for p in referenced_paths)
        if job.modified < cutoff and not holds_a_version:
            found.append(job)
    images = blocks.images.stored_images()
    if images:
        used = blocks.tracking.registered_tag_values(IMAGE_TAG) | blocks.tracking.recent_run_tag_values(
            RUN_IMAGE_TAG, cutoff
        )
        used_digests = {reference.rpartition("@")[2] for reference in used if "@" in reference}
        found += [i for i in images if i.where.rpartition("@")[2] not in used_digests and i.modified < cutoff]
    archives = gpuferry_cache() / "code"
    for archive in sorted(archives.glob("*.tar.gz")) if archives.is_dir() else []:
        info = archive.stat()
        if info.st_mtime < cutoff:
            found.append(
                Garbage(kind="code archive", where=str(archive), size_bytes=info.st_size, modified=info.st_mtime)
            )
    return sorted(found, key=lambda g: g.modified)


def collect(blocks: Stack, items: list[Garbage]) -> int:
    """Free ``items`` (``garbage``'s); the bytes freed."""
    freed = 0
    for item in items:
        if item.kind == "checkpoint":
            blocks.storage.remove(item.where)
        elif item.kind in ("job directory", "code directory"):
            blocks.compute.remove_job(item.where)
        elif item.kind == "image":
            blocks.images.remove_image(item.where)
        else:
            Path(item.where).unlink(missing_ok=True)
        freed += item.size_bytes
    return freed
