"""The image step's interface: what the training job and the inference server run in.

``ImageBuilder.build(workload)`` returns an ``ImageRef`` whose ``reference`` pins the image by digest
(``repo@sha256:...``); every later step runs exactly that. Builders: ``blocks/docker/image.py`` (builds and
pushes with a Docker engine or podman) and ``blocks/local/images.py`` (none: this Python environment).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from blocks.checks import CheckRow, Probe
from blocks.errors import ConfigurationError
from blocks.records import Garbage, ImageRef

if TYPE_CHECKING:
    from blocks.workload.source import Workload

# Where gpuferry's model server (the runtime package) is in every image a builder makes (on PYTHONPATH).
RUNTIME_IN_IMAGE = "/opt/gpuferry"


class ImageBuilder(Block, ABC):
    """Builds the workload's container image and pins it by digest."""

    _block_type_name = "gpuferry Image Builder"

    build_args: dict[str, str] = Field(
        default_factory=dict,
        description="Build arguments for every workload built here (over the workload's own), e.g. BASE_IMAGE "
        "pointing at this site's mirror.",
    )

    # Whether build() returns an image the training job then runs in (checked before anything runs).
    produces_image: ClassVar[bool] = True

    @abstractmethod
    def self_check(self, probe: Probe) -> list[CheckRow]:
        """What ``gpuferry check`` reports of this backend: each check a row of ``probe`` (``blocks/checks.py``). It
        only reads, or writes a probe object and deletes it; ``Stack.check`` runs it with a deadline."""

    @abstractmethod
    def build(self, workload: Workload) -> ImageRef:
        """Build (or find already built) and push the workload's image; return it pinned by digest."""

    # ---- housekeeping (``gpuferry gc``) ----

    def stored_images(self) -> list[Garbage]:
        """The images this builder pushed that its registry still holds, one per digest (``where``: the
        reference by digest, ``modified``: when it was built), for ``gpuferry gc`` to weigh. None here: a
        builder that pushes says (``blocks/docker/image.py``)."""
        return []

    def remove_image(self, where: str) -> None:
        """Delete an image ``stored_images`` listed from its registry."""
        raise ConfigurationError(f"{type(self).__name__} stores no images to remove")
