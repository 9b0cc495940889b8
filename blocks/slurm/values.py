"""The checks of the values that go into a batch script: each error names the option and what is allowed.

Shared by ``script.py`` (the sbatch options and the script) and ``script_image.py`` (the job's container). Pure.
The rules a batch script shares with the other backends (names, variable names, a pinned image) are
``blocks/values.py``'s.
"""

from __future__ import annotations

import re
from typing import Any

from blocks.errors import ConfigurationError

ABSOLUTE_PATH = re.compile(r"^/[A-Za-z0-9_./%+@=-]{0,1023}$")


def refuse(option: str, value: Any, allowed: str) -> None:
    raise ConfigurationError(f"sbatch option {option}={value!r} is not allowed: use {allowed}")


def checked(option: str, value: Any, pattern: re.Pattern[str], allowed: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        refuse(option, value, allowed)
    return value
