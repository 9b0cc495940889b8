"""gpuferry's model server cannot be shadowed by the workload's own files: in an image its working directory is the
workload's, which may hold a ``runtime.py`` (or a ``runtime/`` of its own). The server and the image's build check
run as files (``python /opt/gpuferry/runtime/serve.py``), gpuferry's root first on the path and the working
directory last, so the workload's modules still import (a pickled model's own classes) but never in its place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHADOW = "raise SystemExit('the workload runtime.py was imported instead of gpuferry runtime package')\n"


def as_here(argv: list[str] | tuple[str, ...]) -> list[str]:
    """An image's command run against this checkout: its python, gpuferry's root where the image has it."""
    from blocks.base.images import RUNTIME_IN_IMAGE

    return [sys.executable if a == "python" else a.replace(RUNTIME_IN_IMAGE, str(REPO)) for a in argv]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300)


def test_a_workloads_runtime_py_does_not_shadow_the_check_or_the_server(tmp_path: Path) -> None:
    """The build's check step and the server's command, exactly as the image builder and the serving backends
    write them, run from a working directory that holds a runtime.py."""
    from blocks.base.serving import SERVER_COMMAND
    from blocks.docker.context import _with_runtime

    (tmp_path / "runtime.py").write_text(SHADOW)
    check_step = _with_runtime("FROM scratch", check=True).strip().splitlines()[-1]
    assert check_step.startswith("RUN ")
    check = run(as_here(check_step.removeprefix("RUN ").split()), tmp_path)
    assert check.returncode == 0 and "gpuferry's model server can run here" in check.stdout, check
    # The server starts as gpuferry's: with no MODEL_URI its own settings refuse (not the workload's file).
    serve = run(as_here(SERVER_COMMAND), tmp_path)
    assert serve.returncode != 0 and "MODEL_URI is not set" in serve.stderr, serve.stderr[-2000:]
    assert "workload runtime.py" not in serve.stderr + serve.stdout


def test_the_workloads_own_modules_still_import_after_gpuferrys(tmp_path: Path) -> None:
    """What runtime/serve.py does with the path when run as a file: its root first, the working directory last."""
    (tmp_path / "mymodel.py").write_text("VALUE = 42\n")
    probe = (
        "import runpy, sys; sys.argv = ['serve.py']; "
        f"g = runpy.run_path({str(REPO / 'runtime' / 'serve.py')!r}, run_name='not_main'); "
        "import mymodel, runtime; "
        f"assert runtime.__file__.startswith({str(REPO)!r}), runtime.__file__; "
        "print(mymodel.VALUE, sys.path[-1])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["42", str(tmp_path)]
