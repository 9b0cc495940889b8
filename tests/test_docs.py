"""The docs site: its reference pages are what the code generates, it builds strictly, and its quick start's commands
are the ones the tests run.

* ``docs/reference/`` is written by ``scripts/docs_reference.py`` from the code (the pydantic models of gpuferry.yaml
  and of the stack file's blocks, typer's command tree, the contract's and the model server's docstrings, the
  exception classes): a page that differs from what the code generates now fails here.
* Every environment variable the packages name (an AST scan) is on the environment page.
* ``mkdocs build --strict`` passes: no broken link or anchor, no page left out of the nav.
* The quick start's commands are run by the tests that run README's: its embedded part is exactly what
  tests/test_demo.py runs, its own-cluster part exactly README's blocks, which tests/test_readme.py runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import docs_reference
from tests.test_demo import DEMO_COMMANDS
from tests.test_readme import SECTION, readme_blocks

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


@pytest.mark.parametrize("page", sorted(docs_reference.pages()))
def test_the_reference_page_is_what_the_code_generates(page: str) -> None:
    generated = docs_reference.pages()[page]
    committed = (DOCS / page).read_text() if (DOCS / page).exists() else None
    assert committed == generated, (
        f"docs/{page} is not what the code generates: run `python scripts/docs_reference.py` and commit the result"
    )


def test_every_environment_variable_the_code_names_is_documented() -> None:
    found, dynamic = docs_reference.environment_reads()
    listed = {name for name, _, _ in docs_reference.ENVIRONMENT}
    assert set(found) - listed == set(), "add these to ENVIRONMENT in scripts/docs_reference.py"
    # A read whose variable is named at run time is documented where it is.
    assert dynamic <= set(docs_reference.DYNAMIC_READS), "add these files to DYNAMIC_READS in scripts/docs_reference.py"
    # The scan sees through constants and parameters' defaults.
    assert {"GPUFERRY_HOME", "GPUFERRY_WORK_POOL", "FRONT_PORT", "GPUFERRY_WEBHOOK_SECRET"} <= set(found)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "stack-file" / "index.html").is_file()


def _blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", markdown, re.S)


def test_the_quick_start_runs_what_the_tests_run() -> None:
    text = (DOCS / "quickstart.md").read_text()
    embedded, own = text.split("\n## Your own cluster", 1)
    # The embedded demo: its only command block is what tests/test_demo.py runs, in that order.
    (demo,) = _blocks(embedded, "sh")
    assert [line for line in demo.splitlines() if line.strip()] == DEMO_COMMANDS
    # Your own cluster: README's commands and stack file, which tests/test_readme.py runs.
    commands, stack_file = readme_blocks()
    assert _blocks(own, "sh") == ["\n".join(commands) + "\n"], f"docs/quickstart.md's commands differ from {SECTION}"
    assert _blocks(own, "yaml") == [stack_file], f"docs/quickstart.md's stack file differs from {SECTION}'s"


def test_the_stack_files_in_the_docs_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stack file a page shows (a yaml block with `stacks:`) is one `gpuferry stack apply` takes."""
    from blocks.stack_file import read_stack_file

    for name in ("REGISTRY_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "set-in-the-test")
    found = 0
    for page in sorted(DOCS.rglob("*.md")):
        for block in _blocks(page.read_text(), "yaml"):
            if block.startswith("stacks:") and "~/" not in block:  # the quick start's names files of its own
                assert read_stack_file(block, str(page.relative_to(DOCS)))
                found += 1
    assert found >= 1
