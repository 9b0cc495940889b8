"""``python /opt/gpuferry/runtime/check.py``: does this environment have what gpuferry's model server needs?

Run as the last step of a workload image's build when the workload serves with gpuferry's server, so that
a missing package fails the build (naming it) instead of the deploy. Exits 0 when everything imports, 1
with the list of what is missing otherwise.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: nothing of the working directory (a workload's runtime.py) first
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

NEEDED = {"mlflow.pyfunc": "mlflow-skinny", "numpy": "numpy", "pandas": "pandas", "uvicorn": "uvicorn[standard]"}


def missing() -> list[str]:
    out = []
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            out.append(package)
    return out


def main() -> int:
    lacking = missing()
    if not lacking:
        print("gpuferry's model server can run here")
        return 0
    requirements = Path(__file__).with_name("requirements.txt")
    print(
        f"gpuferry's model server needs {', '.join(lacking)} in the image: add them to the image's requirements "
        f"({requirements.name} beside runtime/ lists everything it uses), or serve with your own server "
        "(serve.command in gpuferry.yaml)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
