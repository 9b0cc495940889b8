"""The content tag: same context → same tag; any change that matters → new tag."""

from __future__ import annotations

from pathlib import Path

import pytest

from blocks.errors import ConfigurationError
from blocks.images import CurrentEnvironment, content_tag


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "Dockerfile").write_text("ARG BASE_IMAGE=debian\nFROM ${BASE_IMAGE}\nCOPY . /app\n")
    (tmp_path / "train.py").write_text("print('train')\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / ".dockerignore").write_text("__pycache__\n*.md\n!README.md\n")
    return tmp_path


def test_stable_and_sensitive(context: Path) -> None:
    tag = content_tag(context)
    assert tag == content_tag(context)
    (context / "train.py").write_text("print('train v2')\n")
    assert content_tag(context) != tag


def test_dockerignore_honoured(context: Path) -> None:
    tag = content_tag(context)
    (context / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\1")
    (context / "notes.md").write_text("changed")
    assert content_tag(context) == tag
    (context / "README.md").write_text("re-included by !README.md")
    assert content_tag(context) != tag


def test_build_args_and_dockerfile_count(context: Path) -> None:
    tag = content_tag(context)
    assert content_tag(context, build_args={"BASE_IMAGE": "debian:12"}) != tag
    (context / "Dockerfile").write_text("FROM debian\n")
    assert content_tag(context) != tag


def test_missing_dockerfile(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no Dockerfile in build context"):
        content_tag(tmp_path)


def test_current_environment_builds_nothing(context: Path) -> None:
    image = CurrentEnvironment(context=str(context)).build()
    assert image.reference is None and not image.built
    assert image.content_tag == content_tag(context)
    assert "no image: runs from the current environment" in image.note
