"""JSON for the inference server: orjson when installed (several times faster), else the standard library."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
    dumps: Callable[[Any], bytes] = orjson.dumps

    def canonical(value: Any) -> bytes:
        """Sorted keys: equal values give equal bytes."""
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)

except ImportError:
    loads = json.loads

    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    def canonical(value: Any) -> bytes:
        """Sorted keys: equal values give equal bytes."""
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def error_body(message: str, error_code: str) -> bytes:
    """MLflow's error body, so its clients read the message where they always have."""
    return dumps({"error_code": error_code, "message": message})
