"""Where the embedded backends keep their state on this machine."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "GPUFERRY_HOME"


def gpuferry_home() -> Path:
    """``$GPUFERRY_HOME``, else ``./.gpuferry`` in the working directory; created on first use."""
    home = Path(os.environ.get(HOME_ENV) or Path.cwd() / ".gpuferry").resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home
