"""The rules for values that reach an outside system, each written once: names, environment variable names, CPU and
memory quantities, image references pinned by digest, registry addresses.

Pure. A refused value raises ``ConfigurationError`` (a ``ValueError`` too, so a pydantic validator that calls one
of these reports it as the field's error), naming the field, the value and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from blocks.errors import ConfigurationError

# A name that ends up in paths, job names, labels, container and Kubernetes object names: no shell metacharacters.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
NAME_LONGEST = 63  # a DNS label's length, which Kubernetes and most registries take; Slurm takes up to 128


def name_help(longest: int = NAME_LONGEST) -> str:
    return f"1-{longest} characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(value: Any, field: str, *, longest: int = NAME_LONGEST) -> str:
    """``value`` when it is a name of at most ``longest`` characters (see ``NAME``); else an error naming ``field``."""
    if not isinstance(value, str) or len(value) > longest or not NAME.match(value):
        raise ConfigurationError(f"{field}={value!r} is not allowed: use {name_help(longest)}")
    return value


# An environment variable's name, as a POSIX shell takes it in an assignment (the secrets file is sourced by one).
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def check_env_names(names: Iterable[str], field: str) -> None:
    for name in names:
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ConfigurationError(
                f"{field}: {name!r} is not a variable name (letters, digits and _, not starting with a digit)"
            )


# A Kubernetes quantity: CPU ("500m", "2") or memory ("512Mi", "4Gi", "1e9" is not taken).
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def check_quantity(value: Any, field: str) -> str:
    if not isinstance(value, str) or not QUANTITY.match(value):
        raise ConfigurationError(f"{field}={value!r} is not a Kubernetes quantity (e.g. '500m', '2', '4Gi')")
    return value


# Docker's reference grammar: a path component of a repository (lowercase), a repository (optionally led by a
# registry host[:port]) and the digest that pins an image.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
PINNED_IMAGE = re.compile(
    rf"^(?P<repo>(?:[A-Za-z0-9][A-Za-z0-9.-]*(?::\d{{1,5}})?/)?{_COMPONENT}(?:/{_COMPONENT})*)@sha256:[0-9a-f]{{64}}$"
)
PINNED_IMAGE_HELP = (
    "REPOSITORY@sha256:<64 hex digits>, e.g. registry.example:5000/team/workload@sha256:... (an image pinned by digest)"
)


def check_pinned_image(reference: Any, field: str = "image") -> str:
    """An image reference pinned by digest, or a ``ConfigurationError`` saying how to pin it: a tag can move between
    a rollout and its rollback, or between a job's submission and its requeue; a digest cannot."""
    if not isinstance(reference, str) or not PINNED_IMAGE.match(reference):
        raise ConfigurationError(
            f"{field}={reference!r} is not pinned by digest: use {PINNED_IMAGE_HELP}; a tag can move, a digest "
            "cannot (DockerImageBuilder returns the pinned reference)"
        )
    return reference


_REGISTRY = re.compile(r"^(?:(?P<scheme>https?)://)?(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?)/?$")


def registry_parts(registry_url: str, field: str = "credentials.registry_url") -> tuple[str | None, str]:
    """A registry address's scheme (None when not written) and host[:port]; Docker Hub's aliases as ``docker.io``."""
    match = _REGISTRY.match(registry_url.strip())
    if not match:
        raise ConfigurationError(
            f"{field}={registry_url!r} is not a registry address: "
            "write host[:port], optionally with http:// or https://, e.g. 127.0.0.1:5000 or ghcr.io"
        )
    host = match["host"]
    if host in ("docker.io", "index.docker.io"):
        host = "docker.io"
    return match["scheme"], host
