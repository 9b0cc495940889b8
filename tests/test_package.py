"""The wheel (what `uv tool install git+<this repository>` installs) carries every file of gpuferry's packages.

An installed gpuferry has no checkout: the files its commands read besides the modules (the model server's
requirements, which go into every image's build context, prefect.yaml, which `gpuferry deploy` and
`gpuferry run` register the deployments from, and the bundled examples `gpuferry init --example` writes) must
come with the packages. tests/test_readme.py runs the
installed command end to end; this checks the wheel's contents in seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_has_every_file_of_the_packages(tmp_path: Path) -> None:
    uv = shutil.which("uv") or str(REPO / ".venv/bin/uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed (make venv installs it)")
    source = tmp_path / "source"  # the committed tree and this checkout's changes, without its build outputs
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for rel in filter(None, tracked):
        path = REPO / rel
        if path.is_file() or path.is_symlink():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                (source / rel).symlink_to(path.readlink())
            else:
                shutil.copy2(path, source / rel)
    done = subprocess.run(
        [uv, "build", "--wheel", "-o", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("gpuferry-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    wanted = set()
    for rel in filter(None, tracked):
        if rel.split("/")[0] not in packages or "/" not in rel:
            continue
        if (REPO / rel).is_dir():  # a link to a directory (deployments/examples): the files it holds
            target = (REPO / rel).resolve().relative_to(REPO).as_posix()
            wanted |= {f"{rel}{t[len(target) :]}" for t in tracked if t.startswith(f"{target}/")}
        else:
            wanted.add(rel)
    assert wanted - names == set()
    assert {"runtime/requirements.txt", "deployments/prefect.yaml", "deployments/examples/digits/train.py"} <= names
    # The packaged prefect.yaml is the checkout's (deployments/prefect.yaml links to it).
    packaged = zipfile.ZipFile(wheel).read("deployments/prefect.yaml")
    assert packaged == (REPO / "prefect.yaml").read_bytes()
