"""Stacks declared in a YAML file, in the blocks' own field names and backend types, saved as Prefect blocks.

.. code-block:: yaml

    stacks:
      hpc:                                   # the Stack block's name
        provider: {type: ClusterManaged, cluster_name: hpc}
        images:
          type: DockerImageBuilder           # a backend type: the block's class name
          repository: team/models
          credentials: {registry_url: registry.example.org, username: ci, password: {env: REGISTRY_PASSWORD}}
        compute:
          type: SlurmCluster
          host: login.hpc.example.org
          credentials:                               # SshCredentials (SshHosts takes the same block)
            user: alice
            private_key: {file: ~/.ssh/id_ed25519}    # secrets are references, never values
            known_hosts: {file: known_hosts}          # relative to this file
        storage: ...
        tracking: {tracking_uri: https://mlflow.example.org}
        serving: {type: KubernetesCluster, kubeconfig: {secret: team-kubeconfig}, namespace: models}

Every step is required; ``type`` picks among the step's backends (``blocks/stack.py``) and may be left out
where there is one (tracking). Nested models take their fields the same way (``type`` only where a field
allows several, e.g. ``bucket.credentials``: AwsCredentials or MinIOCredentials). A string field may be a
reference instead of a value: ``{env: NAME}`` (an environment variable), ``{file: PATH}`` (a file's
content; ``~`` and paths relative to the stack file work) or ``{secret: NAME}`` (an existing Prefect
Secret block). A secret field (private keys, passwords, kubeconfig) must be a reference: a value written in
the file is refused. The SSH login of ``SlurmCluster`` and ``SshHosts`` may still be written flat, as older
files do (``user``, ``private_key``, ``private_key_passphrase``, ``known_hosts`` beside ``host``): the
block moves them into ``credentials``, the form to write.
References are resolved when the file is applied; the saved block holds the value
(Prefect keeps it encrypted and masks it in the UI and the API).

Every problem is reported at once as ``FILE:LINE: FIELD: what is wrong`` (unknown fields list the valid
ones, unknown backends the known ones). ``apply`` saves each stack only when it differs from the saved one
and says what changed; applying the same file twice changes nothing.
"""

from __future__ import annotations

import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, SecretStr, ValidationError

from blocks.config_file import Loc, explain, parse_yaml
from blocks.errors import ConfigurationError
from blocks.stack import STEPS, Stack

REFERENCE_KINDS = ("env", "file", "secret")
STACK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
MASK = "********"


# ---- types -------------------------------------------------------------------------------------------


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation allows (``A | B | None`` → [A, B]; ``list[A]`` → [])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _list_item_models(annotation: Any) -> list[type[BaseModel]]:
    """``list[A]`` (or ``list[A] | None``) → [A]."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            return [m for item in typing.get_args(arg) for m in _models(item)]
    return []


def _is_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    return any(_is_secret(arg) for arg in typing.get_args(annotation))


def step_choices(step: str) -> list[type[BaseModel]]:
    """The backend types the stack's ``step`` takes."""
    return _models(Stack.model_fields[step].annotation)


# ---- reading the file ----------------------------------------------------------------------------------


@dataclass
class _Reader:
    where: str
    base: Path
    lines: dict[Loc, int]
    problems: list[str] = field(default_factory=list)

    def problem(self, loc: Loc, message: str) -> None:
        line = next((self.lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in self.lines), None)
        self.problems.append(f"{self.where}{f':{line}' if line else ''}: {'.'.join(map(str, loc))}: {message}")

    def reference(self, loc: Loc, ref: dict[str, Any]) -> str | None:
        """The value ``{env|file|secret: ...}`` points at."""
        ((kind, target),) = ref.items()
        if not isinstance(target, str) or not target:
            self.problem(loc, f"{{{kind}: ...}} needs a name")
            return None
        if kind == "env":
            if target not in os.environ:
                self.problem(loc, f"environment variable {target} is not set: export it before applying the file")
                return None
            return os.environ[target]
        if kind == "file":
            path = Path(os.path.expanduser(target))
            path = path if path.is_absolute() else self.base / path
            try:
                return path.read_text().rstrip("\r\n")
            except OSError as exc:
                self.problem(loc, f"cannot read {path}: {exc.strerror or exc}")
                return None
        from prefect.blocks.system import Secret

        try:
            value = cast(Secret, Secret.load(target)).get()  # sync here: Prefect types it as a coroutine too
        except ValueError as exc:
            if "Unable to find block document" not in str(exc) and "not found" not in str(exc).lower():
                raise
            self.problem(
                loc,
                f"the Prefect Secret block {target!r} does not exist: create it (Prefect UI → "
                "Blocks → Secret, or `prefect block create secret`)",
            )
            return None
        return value if isinstance(value, str) else str(value)

    def build(self, model: type[BaseModel], data: Any, loc: Loc) -> BaseModel | None:
        """``data`` (a mapping from the file) as ``model``, its nested models built first; None on a problem."""
        if not isinstance(data, dict):
            self.problem(loc, f"expected a mapping of {model.__name__}'s fields, got {type(data).__name__}")
            return None
        values: dict[str, Any] = {}
        ok = True
        for key, value in data.items():
            if key == "type":
                continue
            info = model.model_fields.get(key) if isinstance(key, str) and not key.startswith("_") else None
            if info is None and isinstance(key, str):
                info = _alias_field(model, key)
            if info is None:
                self.problem(
                    (*loc, key), f"unknown field of {model.__name__}; valid fields: {', '.join(model.model_fields)}"
                )
                ok = False
                continue
            built = self.value(info.annotation, value, (*loc, key))
            if built is _FAILED:
                ok = False
            else:
                values[key] = built
        if not ok:
            return None
        try:
            return model.model_validate(values)
        except ValidationError as exc:
            self.problems.extend(explain(exc, model, self.where, self.lines, prefix=loc).splitlines())
            return None

    def value(self, annotation: Any, value: Any, loc: Loc) -> Any:
        models = _models(annotation)
        if models and isinstance(value, dict) and not _is_reference(value):
            chosen = self.choose(models, value, loc)
            if chosen is None:
                return _FAILED
            built = self.build(chosen, value, loc)
            return _FAILED if built is None else built
        items = _list_item_models(annotation)
        if items and isinstance(value, list):
            item = items[0] if len(items) == 1 else typing.Union[tuple(items)]  # noqa: UP007 - built at run time
            out = [self.value(item, v, (*loc, i)) for i, v in enumerate(value)]
            return _FAILED if any(v is _FAILED for v in out) else out
        if _is_reference(value):
            resolved = self.reference(loc, value)
            return _FAILED if resolved is None else resolved
        if _is_secret(annotation) and isinstance(value, str | int) and value != "":
            self.problem(
                loc,
                "is a secret: reference it ({env: NAME}, {file: PATH} or {secret: PREFECT_SECRET_BLOCK}), "
                "never write its value in the file",
            )
            return _FAILED
        return value

    def choose(self, models: list[type[BaseModel]], data: dict[str, Any], loc: Loc) -> type[BaseModel] | None:
        """The model ``data['type']`` names; without ``type``, the only one (or pydantic's pick among several)."""
        names = {m.__name__: m for m in models}
        wanted = data.get("type")
        if wanted is None:
            if len(models) == 1:
                return models[0]
            fitting = [m for m in models if set(data) <= set(m.model_fields)]
            for candidate in fitting:  # the first whose fields all fit and whose values validate
                if _validates(candidate, data):
                    return candidate
            if not fitting:  # a typo: the closest model names the unknown field
                return min(models, key=lambda m: len(set(data) - set(m.model_fields)))
            self.problem((*loc, "type"), f"say which: type: one of {', '.join(names)}")
            return None
        if wanted not in names:
            self.problem((*loc, "type"), f"unknown backend {wanted!r}; known: {', '.join(names)}")
            return None
        return names[wanted]


_FAILED = object()


def _alias_field(model: type[BaseModel], key: str) -> Any:
    """The field an older name of ``model`` stands for (``field_aliases``: the older flat credential fields
    of ``SlurmCluster`` and ``SshHosts`` → ``credentials.<field>``); the model's validator moves the value."""
    target = getattr(model, "field_aliases", {}).get(key)
    if target is None:
        return None
    parent, child = target
    nested = _models(model.model_fields[parent].annotation)
    return nested[0].model_fields.get(child) if nested else None


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in REFERENCE_KINDS


def _validates(model: type[BaseModel], data: dict[str, Any]) -> bool:
    plain = {k: v for k, v in data.items() if not _is_reference(v)}
    try:
        model.model_validate(plain)
    except ValidationError as exc:
        return all(e["type"] == "missing" and e["loc"][0] in data for e in exc.errors())
    return True


def read_stack_file(text: str, where: str, base: Path | None = None) -> dict[str, Stack]:
    """The stacks declared in ``text`` (a stack file's YAML), references resolved; ``ConfigurationError`` lists
    every problem."""
    data, lines = parse_yaml(text, where)
    reader = _Reader(where=where, base=base or Path.cwd(), lines=lines)
    if not isinstance(data, dict) or not isinstance(data.get("stacks"), dict) or not data["stacks"]:
        raise ConfigurationError(
            f"{where}: expected `stacks:` with one or more named stacks (see `gpuferry stack --help`)"
        )
    for key in data:
        if key != "stacks":
            reader.problem((key,), "unknown top-level field; valid fields: stacks")
    out: dict[str, Stack] = {}
    for name, steps in data["stacks"].items():
        loc: Loc = ("stacks", name)
        if not isinstance(name, str) or not STACK_NAME.match(name):
            reader.problem(loc, "a stack's name is 1-63 lowercase letters, digits and '-' (a Prefect block name)")
            continue
        if not isinstance(steps, dict):
            reader.problem(loc, f"expected the steps {', '.join(STEPS)}")
            continue
        blocks: dict[str, Any] = {}
        for step in steps:
            if step not in STEPS:
                reader.problem((*loc, step), f"unknown step; valid fields: {', '.join(STEPS)}")
        for step in STEPS:
            choices = step_choices(step)
            if step not in steps:
                reader.problem(loc, f"{step} is missing: give one of {', '.join(m.__name__ for m in choices)}")
                continue
            value = steps[step] if steps[step] is not None else {}
            built = reader.value(Stack.model_fields[step].annotation, value, (*loc, step))
            if built is not _FAILED:
                blocks[step] = built
        if len(blocks) == len(STEPS):
            out[name] = Stack(**blocks)
    if reader.problems:
        raise ConfigurationError(f"{where} is not valid:\n" + "\n".join(reader.problems))
    return out


def load_stack_file(path: str | Path) -> dict[str, Stack]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigurationError(f"{path}: no such file") from None
    return read_stack_file(text, str(path), path.resolve().parent)


# ---- what a stack holds, and what changed ---------------------------------------------------------------


def flatten(model: BaseModel, prefix: str = "") -> dict[str, tuple[Any, bool]]:
    """Every field of ``model`` (nested ones as dotted paths, a ``type`` per nested model) → (value, secret)."""
    out: dict[str, tuple[Any, bool]] = {}
    if prefix:
        out[f"{prefix}type"] = (type(model).__name__, False)
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out.update(flatten(value, f"{path}."))
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{path}.{i}."))
        elif isinstance(value, SecretStr):
            out[path] = (value.get_secret_value(), True)
        else:
            out[path] = (
                value.model_dump(mode="json") if hasattr(value, "model_dump") else value,
                _is_secret(info.annotation),
            )
    return out


@dataclass
class Change:
    path: str
    before: Any
    after: Any
    secret: bool

    def __str__(self) -> str:
        if self.secret:
            what = "set" if self.before is None else "removed" if self.after is None else "changed"
            return f"{self.path}: (secret) {what}"
        if self.before is None and self.after is not None:
            return f"{self.path}: {self.after!r}"
        return f"{self.path}: {self.before!r} → {self.after!r}"


def changes(before: Stack | None, after: Stack) -> list[Change]:
    """What saving ``after`` over ``before`` changes (every field when there is no ``before``)."""
    old = flatten(before) if before is not None else {}
    new = flatten(after)
    out = []
    for path in sorted(
        set(old) | set(new), key=lambda p: (STEPS.index(p.split(".")[0]) if p.split(".")[0] in STEPS else 99, p)
    ):
        a, b = old.get(path, (None, False)), new.get(path, (None, False))
        if a[0] != b[0]:
            out.append(Change(path, a[0], b[0], a[1] or b[1]))
    return out


@dataclass
class Applied:
    name: str
    action: str  # created, updated, unchanged
    changes: list[Change]


def saved_stack(name: str) -> Stack | None:
    """The saved Stack block ``name``, or None."""
    try:
        return cast(Stack, Stack.load(name))  # sync here: Prefect types it as a coroutine too
    except ValueError as exc:
        if "Unable to find block document" in str(exc) or "not found" in str(exc).lower():
            return None
        raise


def apply(stacks: dict[str, Stack], *, dry_run: bool = False) -> list[Applied]:
    """Save each stack that differs from its saved block (``dry_run``: only say what would change)."""
    out = []
    for name, stack in stacks.items():
        before = saved_stack(name)
        diff = changes(before, stack)
        action = "created" if before is None else "updated" if diff else "unchanged"
        if diff and not dry_run:
            stack.save(name, overwrite=True)
        out.append(Applied(name, action, diff if before is not None else []))
    return out


def describe(stack: Stack) -> dict[str, Any]:
    """The stack as a stack file would declare it: each step's type and the fields not at their default,
    secrets masked."""
    return {step: _declared(getattr(stack, step)) for step in STEPS}


def _declared(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(model).__name__}
    defaults = type(model)
    for name, info in defaults.model_fields.items():
        value = getattr(model, name)
        default = info.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            out[name] = _declared(value)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            out[name] = [_declared(v) for v in value]
        elif isinstance(value, SecretStr):
            out[name] = MASK
        elif value != default:
            out[name] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return out
