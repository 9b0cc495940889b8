"""What a scoring request got wrong, in words: where a JSON array departs from a tensor signature's shape, the
first element that is not a number, what a JSON value is. Pure functions; ``runtime.scoring`` turns them into 422s."""

from __future__ import annotations

import json
from typing import Any

NUMBER = frozenset({int, float})


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join("any" if d == -1 else str(d) for d in shape) + ")"


def index_text(index: tuple[int, ...]) -> str:
    return "".join(f"[{i}]" for i in index)


def shape_problem(value: list[Any], shape: tuple[int, ...], field: str) -> str | None:
    """Where a nested list first departs from ``shape`` (its first dimension is the request's rows)."""
    inner = list(shape[1:])
    reference = value[0]  # dimensions left free (-1) take the first row's sizes
    for d in range(len(inner)):
        if inner[d] == -1:
            inner[d] = len(reference) if type(reference) is list else -1
        if type(reference) is not list or not reference:
            break
        reference = reference[0]

    def walk(node: Any, dims: list[int], path: str) -> str | None:
        if not dims:
            return f'"{path}" must be a number, got a list' if type(node) is list else None
        if type(node) is not list:
            hint = ""
            if path == f"{field}[0]" and len(value) == dims[0] and len(dims) == 1:
                hint = f' (a single row is a list of one row: {{"{field}": [[...]]}})'
            return (
                f'"{path}" must be a list of {dims[0] if dims[0] != -1 else "the"} values, got {describe(node)}{hint}'
            )
        if dims[0] != -1 and len(node) != dims[0]:
            return f'"{path}" has {len(node)} values; the signature expects {dims[0]} (shape {shape_text(shape)})'
        for i, child in enumerate(node):
            if problem := walk(child, dims[1:], f"{path}[{i}]"):
                return problem
        return None

    for i, row in enumerate(value):
        if problem := walk(row, inner, f"{field}[{i}]"):
            return problem
    return None


def element_problem(value: Any, path: str, nulls: bool) -> str | None:
    """The first element of a nested list that is not a number (or null, where ``nulls``)."""
    if type(value) is list:
        for i, child in enumerate(value):
            if problem := element_problem(child, f"{path}[{i}]", nulls):
                return problem
        return None
    if type(value) in NUMBER or type(value) is bool or (nulls and value is None):
        return None
    return f'"{path}" must be a number, got {describe(value)}'


def describe(value: Any) -> str:
    """What a JSON value is, for error messages: 'a string ("abc")', 'null', 'an object'."""
    if value is None:
        return "null"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"{kind} ({json.dumps(value)[:40]})" if type(value) in (str, bool, int, float) else kind
