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


CACHE_ENV = "GPUFERRY_CACHE"


def gpuferry_cache() -> Path:
    """``$GPUFERRY_CACHE``, else ``~/.cache/gpuferry``: what is built once per machine (git mirrors, code archives)."""
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gpuferry")
    cache.mkdir(parents=True, exist_ok=True)
    return cache
