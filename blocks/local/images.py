"""No image: ``CurrentEnvironment``, the embedded default image builder.

It builds nothing: jobs run from this Python environment, and the run records so.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, ClassVar

from blocks.base.images import ImageBuilder
from blocks.checks import CheckRow, Probe
from blocks.records import ImageRef

if TYPE_CHECKING:
    from blocks.workload.source import Workload


class CurrentEnvironment(ImageBuilder):
    """No image: jobs run from the Python environment the flow runs in."""

    _block_type_name = "gpuferry Current Environment"
    _description = "Builds no image; training and serving run from the current Python environment."
    produces_image: ClassVar[bool] = False

    def build(self, workload: Workload) -> ImageRef:
        return ImageRef(
            builder=self.get_block_type_slug(),
            content_tag=workload.code.sha256[:20],
            reference=None,
            built=False,
            note=f"no image: runs from the current environment ({sys.executable}, {os.uname().machine})",
        )

    def self_check(self, probe: Probe) -> list[CheckRow]:
        probe.info("image", f"none: jobs run from this Python environment ({sys.executable})")
        return probe.rows
