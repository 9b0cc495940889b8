"""The bundled example workloads, for tests: their directories, and their modules imported as a job would."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from blocks.records import CodeRef
from blocks.workload.source import code_archive

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
DIGITS = EXAMPLES / "digits"
DIABETES = EXAMPLES / "diabetes"


def example_module(example: Path, name: str) -> ModuleType:
    """``example/<name>.py`` imported the way the example's own script imports it (its directory on sys.path),
    under a name of its own so that two examples' modules never collide."""
    key = f"example_{example.name}_{name}"
    if key in sys.modules:
        return sys.modules[key]
    if str(example) not in sys.path:
        sys.path.insert(0, str(example))
    spec = importlib.util.spec_from_file_location(key, example / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def code_of(directory: Path) -> CodeRef:
    """The code archive of ``directory`` (what a job without an image runs from)."""
    return code_archive(directory)


JOBS = REPO / "tests" / "jobs"  # small programs the compute tests run as jobs
