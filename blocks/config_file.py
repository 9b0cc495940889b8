"""YAML configuration files read into pydantic models, with errors that name the file, the line and the field.

``load_yaml(path, Model)`` parses ``path`` (safe YAML: no tags, no code), validates it as ``Model`` and on a
bad value raises ``ConfigurationError`` listing every problem as ``FILE:LINE: FIELD: what is wrong``; an
unknown field also lists the valid fields of the model it appears in. Pure: reads only the file it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from blocks.errors import ConfigurationError

M = TypeVar("M", bound=BaseModel)
Loc = tuple[str | int, ...]


def _lines(node: yaml.Node, loc: Loc, out: dict[Loc, int]) -> None:
    """The 1-based line of every key and item under ``node``, by its location (the path of keys)."""
    out.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = (*loc, key.value)
            out[child] = key.start_mark.line + 1
            _lines(value, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _lines(item, (*loc, index), out)


def parse_yaml(text: str, where: str) -> tuple[Any, dict[Loc, int]]:
    """The document in ``text`` and the line of every location in it."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigurationError(f"{where}{line}: not valid YAML: {problem}") from None
    lines: dict[Loc, int] = {}
    if node is not None:
        _lines(node, (), lines)
    return data, lines


def _model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The pydantic model that holds the field at ``loc`` (None when it is not a model's field)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = field.annotation
        for arg in getattr(current, "__args__", ()) or ():  # Optional[Model], Model | None
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def explain(exc: ValidationError, model: type[BaseModel], where: str, lines: dict[Loc, int], prefix: Loc = ()) -> str:
    """Every error of ``exc`` as ``where:LINE: FIELD: message`` (the valid fields for an unknown one).

    ``prefix``: where ``model`` sits in the file (its errors' fields and lines are looked up under it)."""
    problems = []
    for error in exc.errors():
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and "[" in p))  # drop union branch tags
        full = (*prefix, *loc)
        field = ".".join(str(p) for p in full) or "(top level)"
        line = next((lines[full[:n]] for n in range(len(full), -1, -1) if full[:n] in lines), None)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            valid = ", ".join(parent.model_fields) if parent is not None else ""
            message = f"unknown field{'; valid fields: ' + valid if valid else ''}"
        elif error["type"] == "missing":
            message = "required field is missing"
        problems.append(f"{where}{f':{line}' if line else ''}: {field}: {message}")
    return "\n".join(problems)


def validate_yaml(text: str, model: type[M], where: str) -> M:
    """``text`` (YAML) validated as ``model``; ``ConfigurationError`` naming every bad field and its line."""
    data, lines = parse_yaml(text, where)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigurationError(f"{where}: the file must hold a mapping of fields, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigurationError(f"{where} is not valid:\n{explain(exc, model, where, lines)}") from None


def load_yaml(path: str | Path, model: type[M]) -> M:
    """The YAML file ``path`` validated as ``model``."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigurationError(f"{path}: no such file") from None
    return validate_yaml(text, model, str(path))
