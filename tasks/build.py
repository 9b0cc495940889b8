"""Build the workload's image."""

from __future__ import annotations

from prefect import get_run_logger, task

from blocks.base.images import ImageBuilder
from blocks.records import ImageRef
from blocks.workload.source import Workload
from tasks.retry import retry_options


@task(name="build-image", **retry_options(retries=3))
def build_image(builder: ImageBuilder, workload: Workload) -> ImageRef:
    image = builder.build(workload)
    logger = get_run_logger()
    if image.reference is None:
        logger.info("image: %s (content tag %s)", image.note, image.content_tag)
    else:
        logger.info("image: %s (%s)", image.reference, "built" if image.built else "already in the registry")
    return image
