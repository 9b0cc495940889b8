"""What `gpuferry gc` frees in an image registry (the registry stack: docker-registry with deletes on, podman's
Docker API building and pushing): an image of the builder's repository that no registered version was trained in
and no recent training run uses, built longer ago than the limit. The MLflow side is the embedded store; the
clock is moved 40 days on (`garbage(now=...)`), and a run "started yesterday" is created with that start time."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import docker
import pytest

from blocks.errors import ConfigurationError
from blocks.housekeeping import collect, garbage
from blocks.records import IMAGE_TAG, RUN_IMAGE_TAG
from blocks.stack import Stack
from tests.test_docker_image import (  # noqa: F401 - fixtures
    builder,
    context,
    engine,
    registry_manifest,
    repository,
    stack,
    tiny,
)

DAY = 86400.0


def test_an_images_build_time_is_read_from_its_configuration() -> None:
    from blocks.docker.image import _created

    assert _created("2026-11-05T10:20:30.123456789Z") == pytest.approx(1793874030.123456)
    assert _created("2026-11-05T11:20:30+01:00") == 1793874030.0
    assert _created(None) is None and _created("yesterday") is None


@pytest.mark.integration
def test_gc_frees_only_images_nothing_registered_or_running_uses(
    stack: dict[str, str], engine: docker.DockerClient, context: Path, repository: str
) -> None:
    b = builder(stack, repository)
    built = []
    for n in range(3):  # three contents, three images: A, B, C
        (context / "app.txt").write_text(f"image {n} {uuid.uuid4()}\n")
        built.append(b.build(tiny(context)))
    a, bee, c = (image.reference for image in built)
    assert a and bee and c

    stored = {item.where: item for item in b.stored_images()}
    assert set(stored) == {a, bee, c}, stored
    assert all(item.kind == "image" and item.size_bytes > 0 for item in stored.values())
    assert all(abs(item.modified - time.time()) < 900 for item in stored.values())  # built just now

    blocks = Stack.embedded().model_copy(update={"images": b})
    client = blocks.tracking.client
    model = f"gc-images-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(model)
    client.create_model_version(model, source="file:///nowhere", tags={IMAGE_TAG: a})  # A: a version's
    now = time.time() + 40 * DAY
    experiment = client.create_experiment(f"gc-images-{uuid.uuid4().hex[:6]}")
    client.create_run(experiment, start_time=int((now - DAY) * 1000), tags={RUN_IMAGE_TAG: bee})  # B: a run's

    listed = [item for item in garbage(blocks, 30, now=now) if item.kind == "image"]
    assert [item.where for item in listed] == [c]
    assert not [item for item in garbage(blocks, 30) if item.kind == "image"]  # today all three are young

    collect(blocks, listed)
    digest = {ref: ref.rpartition("@")[2] for ref in (a, bee, c)}
    assert registry_manifest(stack, repository, digest[c]).status_code == 404
    assert registry_manifest(stack, repository, built[2].content_tag).status_code == 404  # its tag went with it
    for kept in (a, bee):
        assert registry_manifest(stack, repository, digest[kept]).status_code == 200
    assert {item.where for item in b.stored_images()} == {a, bee}
    # Its content is built again when a workload needs it.
    again = b.build(tiny(context))
    assert again.built and again.content_tag == built[2].content_tag

    with pytest.raises(ConfigurationError, match="is not an image of"):
        b.remove_image(f"other.example/{repository}@{digest[a]}")
