"""Golden-file checks: what the code makes, compared with a file kept in tests/golden/.

Regenerate the files after an intended change with GPUFERRY_UPDATE_GOLDEN=1 (and read the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"


def check_text(path: Path, text: str) -> None:
    if os.environ.get("GPUFERRY_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with GPUFERRY_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), (
        f"{path.name} differs from {path} (GPUFERRY_UPDATE_GOLDEN=1 after an intended change)"
    )


def check_json(path: Path, value: object) -> None:
    check_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")
