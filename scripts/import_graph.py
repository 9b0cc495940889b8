"""Print gpuferry's import graph: its circles, and the largest files and folders.

``python scripts/import_graph.py`` reads every import of the packages (type-checking imports and imports inside
functions included, as a reader or a type checker sees them) with grimp, import-linter's graph library, and prints:

* each circle of modules that import one another (a strongly connected component of two or more modules), the
  ones inside one folder marked as such, with the edges that close it;
* the largest files and folders by lines.

``--edges`` prints every import edge between gpuferry's modules as well. Exit status 1 when there is a circle
other than a block and its own check in one folder (``blocks/slurm/cluster.py`` and ``blocks/slurm/check.py``: the
block runs its check, the check reads the block's settings). ``make test`` runs it, beside import-linter's
contracts (``pyproject.toml``), which keep the layers.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import grimp

PACKAGES = ("blocks", "tasks", "flows", "deployments", "runtime")
ROOT = Path(__file__).resolve().parent.parent


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found, key=len, reverse=True)


def folder(module: str) -> str:
    """The folder a module is in: its package (a package's ``__init__`` is in its own folder)."""
    path = ROOT / Path(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def lines_of(path: Path) -> int:
    return sum(1 for _ in path.open(encoding="utf-8"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every import edge too")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    edges = [(a, b) for a in sorted(graph.modules) for b in sorted(graph.find_modules_directly_imported_by(a))]
    print(f"{len(graph.modules)} modules, {len(edges)} imports between them")
    if args.edges:
        for a, b in edges:
            print(f"  {a} -> {b}")
    refused = 0
    found = circles(graph)
    print(f"{len(found)} circle(s)")
    for component in found:
        folders = {folder(m) for m in component}
        inside = len(folders) == 1
        allowed = inside and len(component) == 2 and any(m.rsplit(".", 1)[1] == "check" for m in component)
        refused += not allowed
        members = set(component)
        closing = [
            f"{a} -> {b}" for a in component for b in sorted(graph.find_modules_directly_imported_by(a)) if b in members
        ]
        where = f" (inside {folders.pop()})" if inside else ""
        verdict = "a block and its own check" if allowed else "NOT ALLOWED"
        print(f"- {len(component)} modules{where}, {verdict}: {', '.join(component)}")
        for edge in closing:
            print(f"    {edge}")
    files = sorted(
        ((lines_of(p), p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")), reverse=True
    )
    per_folder: dict[Path, int] = defaultdict(int)
    for n, path in files:
        per_folder[path.parent] += n
    print("largest files: " + ", ".join(f"{p} ({n})" for n, p in files[:5]))
    print(
        "largest folders: " + ", ".join(f"{p}/ ({n})" for p, n in sorted(per_folder.items(), key=lambda x: -x[1])[:5])
    )
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
