"""Image builders: what the training job and the inference server run in.

``ImageBuilder.build()`` returns an ``ImageRef`` whose ``reference`` pins the image by digest
(``repo@sha256:...``); every later step runs exactly that. The tag is a hash of the build context
(honouring ``.dockerignore``), the Dockerfile and the build args, so an unchanged context is never
rebuilt.

The embedded default, ``CurrentEnvironment``, builds nothing: jobs run from this Python
environment, and the run records so.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from blocks.errors import ConfigurationError
from blocks.specs import ImageRef
from runtime import contract

WORKLOAD_DIR = Path(contract.__file__).resolve().parent


def _dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    patterns = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append(line.rstrip("/"))
    return patterns


def _ignored(rel: str, patterns: list[str]) -> bool:
    """``.dockerignore`` semantics for the common cases: globs, ``**``, and ``!`` exceptions (last wins)."""
    ignored = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.lstrip("/")
        hit = any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", "")) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def content_tag(context: str | Path, dockerfile: str = "Dockerfile", build_args: dict[str, str] | None = None) -> str:
    """sha256 over the context's files (path, mode, bytes), the Dockerfile and the build args."""
    root = Path(context)
    if not (root / dockerfile).is_file():
        raise ConfigurationError(f"no {dockerfile} in build context {root}: set dockerfile or context")
    patterns = _dockerignore(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != dockerfile and _ignored(rel, patterns):
            continue
        digest.update(rel.encode() + b"\0" + oct(path.stat().st_mode & 0o777).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    digest.update(b"dockerfile\0" + dockerfile.encode())
    for key, value in sorted((build_args or {}).items()):
        digest.update(f"arg\0{key}={value}\0".encode())
    return digest.hexdigest()[:20]


class ImageBuilder(Block, ABC):
    """Builds the workload's container image and pins it by digest."""

    _block_type_name = "gpuferry Image Builder"

    context: str = Field(str(WORKLOAD_DIR), description="Build context directory (the workload we ship).")
    dockerfile: str = Field("Dockerfile", description="Dockerfile, relative to the context.")
    build_args: dict[str, str] = Field(default_factory=dict, description="Docker build arguments.")

    # Whether build() returns an image the training job then runs in (checked before anything runs).
    produces_image: ClassVar[bool] = True

    @abstractmethod
    def build(self) -> ImageRef:
        """Build (or find already built) and push the image; return it pinned by digest."""

    def tag(self) -> str:
        return content_tag(self.context, self.dockerfile, self.build_args)


class CurrentEnvironment(ImageBuilder):
    """No image: jobs run from the Python environment the flow runs in."""

    _block_type_name = "gpuferry Current Environment"
    _description = "Builds no image; training and serving run from the current Python environment."
    produces_image: ClassVar[bool] = False

    def build(self) -> ImageRef:
        return ImageRef(
            builder=self.get_block_type_slug(),
            content_tag=self.tag(),
            reference=None,
            built=False,
            note=f"no image: runs from the current environment ({sys.executable}, {os.uname().machine})",
        )
