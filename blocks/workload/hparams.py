"""A workload's hyperparameters, declared as a JSON Schema and checked before anything is acquired or submitted.

The workload file declares the schema (types, defaults, bounds, enums, required). ``HyperparameterSchema``
checks the schema itself when the file is read, fills in the declared defaults, refuses a key the schema
does not declare (naming the valid ones: a typo must not be ignored) and turns every violation into a line
``hyperparameters.NAME: what is wrong``. Objects are closed unless the schema says
``additionalProperties``. A whole number given where the schema declares a ``number`` becomes a float, so
the job receives, and logs, the type it declared. Pure: no outside calls.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from blocks.errors import ConfigurationError

FIELD = "hyperparameters"


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that declares properties and says nothing."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def _with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with the defaults of the properties it lacks, at every level where the schema has properties.

    An object left out whose schema has no ``default`` of its own is made from its properties' defaults (when
    they give every property it requires): the job gets ``{"schedule": {"warmup": 2}}`` as the form shows it."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(sub, dict):
            continue
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        elif name not in out and sub.get("properties"):
            made = _with_defaults(sub, {})
            if made and set(sub.get("required") or []) <= set(made):
                out[name] = made
        if name in out:
            out[name] = _with_defaults(sub, out[name])
    return out


def _normalized(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with integers where the schema declares a ``number`` made floats (``0`` → ``0.0``), at every
    level: a form or a YAML file writes ``0`` for a float, and the job, casting to the declared type, would log
    ``0.0`` to the MLflow run whose params already say ``0`` (MLflow refuses a changed param)."""
    declared = schema.get("type")
    if declared == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        return {
            k: _normalized(properties[k], v) if isinstance(properties.get(k), dict) else v for k, v in value.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_normalized(schema["items"], v) for v in value]
    return value


def _path(parts: Iterable[Any]) -> str:
    text = FIELD
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


class HyperparameterSchema:
    """The JSON Schema of a workload's hyperparameters, ready to validate values against."""

    def __init__(self, schema: Mapping[str, Any] | None, where: str = "hyperparameters") -> None:
        raw = dict(schema or {"type": "object", "properties": {}})
        raw.setdefault("type", "object")
        if raw.get("type") != "object":
            raise ConfigurationError(f"{where}: the schema must describe an object (type: object), not {raw['type']!r}")
        try:
            Draft202012Validator.check_schema(raw)
        except SchemaError as exc:
            at = ".".join(str(p) for p in exc.path)
            raise ConfigurationError(
                f"{where}{'.' + at if at else ''}: not a valid JSON Schema: {exc.message}"
            ) from None
        self.schema: dict[str, Any] = raw
        self._validator = Draft202012Validator(closed(raw))
        defaults = _with_defaults(raw, {})
        problems = self._problems(defaults, check_required=False)
        if problems:
            raise ConfigurationError(f"{where}: a declared default is not valid: {'; '.join(problems)}")

    @property
    def names(self) -> list[str]:
        """The declared top-level hyperparameters, in the order the schema lists them."""
        return list((self.schema.get("properties") or {}).keys())

    @property
    def defaults(self) -> dict[str, Any]:
        return _with_defaults(self.schema, {})

    def _problems(self, value: Any, check_required: bool = True) -> list[str]:
        out = []
        for error in sorted(self._validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path]):
            if error.validator == "required" and not check_required:
                continue
            if error.validator == "additionalProperties" and isinstance(error.instance, dict):
                known = list((error.schema.get("properties") or {}).keys())
                unknown = sorted(set(error.instance) - set(known))
                valid = ", ".join(known) or "(none declared)"
                for name in unknown:
                    out.append(f"{_path([*error.absolute_path, name])}: not a declared hyperparameter; valid: {valid}")
                continue
            out.append(f"{_path(error.absolute_path)}: {error.message}")
        return out

    def validate(self, values: Mapping[str, Any] | None, what: str = FIELD) -> dict[str, Any]:
        """``values`` with the declared defaults filled in; ``ConfigurationError`` listing every problem."""
        if values is not None and not isinstance(values, Mapping):
            raise ConfigurationError(f"{what} must be a mapping of name to value, got {type(values).__name__}")
        filled = _with_defaults(self.schema, dict(values or {}))
        problems = self._problems(filled)
        if problems:
            raise ConfigurationError(f"{what} do not match the workload's schema:\n  " + "\n  ".join(problems))
        return _normalized(self.schema, filled)

    def expand_grid(
        self, base: Mapping[str, Any], values: Mapping[str, list[Any]], configurations: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """Every combination of ``values`` (row-major, in the order given), then ``configurations``, each on
        ``base`` and validated; ``ConfigurationError`` naming the configuration and what is wrong."""
        declared = self.names
        for name in [*values, *(k for c in configurations for k in c)]:
            if name not in declared:
                raise ConfigurationError(
                    f"grid: {name!r} is not a declared hyperparameter of the workload; valid: {', '.join(declared)}"
                )
        names = list(values)
        overrides = (
            [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values.values())] if names else []
        )
        overrides += [dict(c) for c in configurations]
        out = []
        for index, override in enumerate(overrides):
            try:
                out.append(self.validate({**base, **override}))
            except ConfigurationError as exc:
                raise ConfigurationError(f"grid: configuration {index} {override}: {exc}") from None
        return out
