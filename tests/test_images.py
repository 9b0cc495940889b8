"""The build context: what the engine receives for a workload, and its tag (the hash of exactly those bytes)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from blocks.docker.context import DOCKERFILE, build_context, generated_dockerfile
from blocks.errors import ConfigurationError
from blocks.local.images import CurrentEnvironment
from blocks.workload.source import load_workload

WORKLOAD = """\
name: ctx-test
image: {image}
train: {{command: [python, train.py]}}
promotion: {{metric: m}}
{serve}
"""


def workload(root: Path, image: str = "{dockerfile: Dockerfile}", serve: str = "", files: dict[str, str] | None = None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "gpuferry.yaml").write_text(WORKLOAD.format(image=image, serve=serve))
    defaults = {
        "Dockerfile": "ARG BASE_IMAGE=debian\nFROM ${BASE_IMAGE}\nWORKDIR /srv/app\nCOPY . .\n",
        "train.py": "print('train')\n",
    }
    for name, content in {**defaults, **(files or {})}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return load_workload(str(root))


def members(tar: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def test_the_tag_is_stable_and_follows_every_byte_the_engine_sees(tmp_path: Path) -> None:
    first = build_context(workload(tmp_path / "w"))
    assert build_context(workload(tmp_path / "w")).tag == first.tag
    assert build_context(workload(tmp_path / "w"), {"BASE_IMAGE": "debian:12"}).tag != first.tag
    changed = workload(tmp_path / "w", files={"train.py": "print('v2')\n"})
    assert build_context(changed).tag != first.tag


def test_dockerignore_follows_dockers_own_rules(tmp_path: Path) -> None:
    # Docker matches `*.md` at the context's root only; `**/*.log` everywhere; `!` re-includes.
    files = {
        ".dockerignore": "*.md\n**/*.log\n!keep.log\n",
        "notes.md": "a",
        "docs/guide.md": "b",
        "x/y.log": "c",
        "keep.log": "d",
    }
    ctx = build_context(workload(tmp_path / "w", files=files))
    names = set(members(ctx.tar))
    assert "notes.md" not in names and "x/y.log" not in names
    assert {"docs/guide.md", "keep.log", "train.py", "Dockerfile"} <= names
    root_md = build_context(workload(tmp_path / "w", files={**files, "notes.md": "changed"}))
    assert root_md.tag == ctx.tag  # ignored: no rebuild
    nested_md = build_context(workload(tmp_path / "w", files={**files, "docs/guide.md": "changed"}))
    assert nested_md.tag != ctx.tag  # not ignored by `*.md`: a new image, never a stale one


def test_gpuferrys_state_never_reaches_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a .dockerignore: gpuferry's state in the workload (./.gpuferry, or $GPUFERRY_HOME pointed inside it)
    is not built into the image, and a change to it does not make a new one."""
    root = tmp_path / "w"
    monkeypatch.setenv("GPUFERRY_HOME", str(root / "state"))
    state = {".gpuferry/mlflow.db": "db", "state/cache/sha256.json": "{}", "stateful.py": "kept\n"}
    ctx = build_context(workload(root, files=state))
    names = set(members(ctx.tar))
    assert not [n for n in names if n.startswith(("state/", ".gpuferry/mlflow"))], names
    assert {"stateful.py", "train.py", "Dockerfile"} <= names
    changed = build_context(workload(root, files={**state, ".gpuferry/mlflow.db": "db2", "state/cache/x": "1"}))
    assert changed.tag == ctx.tag


@pytest.mark.parametrize("ignore", [".gpuferry/\n", "*\n!train.py\n!Dockerfile\n"])
def test_the_engine_applying_the_dockerignore_again_keeps_what_gpuferry_adds(tmp_path: Path, ignore: str) -> None:
    """The engine applies the context's .dockerignore once more (Docker's rules, as here): a workload that ignores
    `.gpuferry/` (its state), or everything but what it lists, still gets gpuferry's Dockerfile and runtime."""
    from docker.utils.build import exclude_paths

    ctx = build_context(workload(tmp_path / "w", files={".dockerignore": ignore}))
    unpacked = tmp_path / "engine"
    with tarfile.open(fileobj=io.BytesIO(ctx.tar)) as t:
        t.extractall(unpacked, filter="data")
    patterns = [p for p in (unpacked / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[: len(ignore.split())] == ignore.split()  # the workload's own patterns, first and unchanged
    seen = set(exclude_paths(str(unpacked), patterns, dockerfile=DOCKERFILE))
    assert {DOCKERFILE, ".gpuferry/runtime/requirements.txt", ".gpuferry/runtime/serve.py", "train.py"} <= seen


def test_gpuferrys_model_server_goes_into_the_final_stage(tmp_path: Path) -> None:
    ctx = build_context(workload(tmp_path / "w"))
    files = members(ctx.tar)
    dockerfile = files[DOCKERFILE].decode()
    assert ctx.dockerfile == DOCKERFILE and ctx.workdir == "/srv/app"
    assert dockerfile.startswith("ARG BASE_IMAGE=debian\nFROM ${BASE_IMAGE}\nWORKDIR /srv/app\nCOPY . .\n")
    assert "COPY .gpuferry/runtime /opt/gpuferry/runtime" in dockerfile
    assert "ENV PYTHONPATH=/opt/gpuferry${PYTHONPATH:+:${PYTHONPATH}}" in dockerfile
    assert dockerfile.rstrip().endswith("RUN python /opt/gpuferry/runtime/check.py")
    assert ".gpuferry/runtime/serve.py" in files and ".gpuferry/runtime/contract.py" in files
    own = build_context(workload(tmp_path / "own", serve="serve: {command: [python, serve.py], port: 9000}"))
    assert "runtime/check.py" not in members(own.tar)[DOCKERFILE].decode()  # its own server: no check


def test_a_generated_dockerfile_installs_the_requirements_and_the_servers(tmp_path: Path) -> None:
    w = workload(
        tmp_path / "w",
        image="{base: 'python:3.11-slim', requirements: requirements.txt}",
        files={"requirements.txt": "scikit-learn\n"},
    )
    ctx = build_context(w, {"BASE_IMAGE": "localhost/base:1"})
    dockerfile = members(ctx.tar)[DOCKERFILE].decode()
    assert dockerfile.startswith(generated_dockerfile("python:3.11-slim", "requirements.txt"))
    assert "-r /tmp/gpuferry-requirements/workload.txt -r /tmp/gpuferry-requirements/runtime.txt" in dockerfile
    assert ctx.build_args == {"BASE_IMAGE": "localhost/base:1"} and ctx.workdir == "/workload"
    with pytest.raises(ConfigurationError, match="image.requirements='requirements.txt': no such file"):
        (tmp_path / "w" / "requirements.txt").unlink()
        build_context(w)


def test_a_prebuilt_image_gets_the_server_on_top(tmp_path: Path) -> None:
    digest = "registry.example/team/img@sha256:" + "a" * 64
    ctx = build_context(workload(tmp_path / "w", image=f"{{prebuilt: '{digest}', workdir: /app}}"))
    dockerfile = members(ctx.tar)[DOCKERFILE].decode()
    assert dockerfile.startswith(f"FROM {digest}\n") and ctx.workdir == "/app"
    assert "train.py" not in members(ctx.tar)  # the code is in the image already


def test_no_image_section(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "gpuferry.yaml").write_text("name: n\ntrain: {command: [python, t.py]}\npromotion: {metric: m}\n")
    (tmp_path / "w" / "t.py").write_text("")
    w = load_workload(str(tmp_path / "w"))
    with pytest.raises(ConfigurationError, match="gpuferry.yaml has no image section"):
        build_context(w)
    image = CurrentEnvironment().build(w)
    assert image.reference is None and not image.built
    assert image.content_tag == w.code.sha256[:20]
    assert "no image: runs from the current environment" in image.note
