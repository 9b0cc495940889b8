"""Deterministic tar archives: the same files give the same bytes, so an archive's sha256 names its content.

Entries are written in the order given (callers sort them), with no timestamps, owners or user names, and
mode 0755 for an executable file, 0644 otherwise. Pure: reads only the files it is given.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path


def deterministic_tar(entries: Iterable[tuple[str, Path | bytes]]) -> bytes:
    """A tar of ``(name in the archive, a file's path or the bytes themselves)`` entries."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if isinstance(content, bytes):
                info.size, info.mode = len(content), 0o644
                tar.addfile(info, io.BytesIO(content))
                continue
            info.size = content.stat().st_size
            info.mode = 0o755 if os.access(content, os.X_OK) else 0o644
            with open(content, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()
