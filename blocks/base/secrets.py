"""The values of a workload's secrets, from Prefect Secret blocks (the workload file names only the blocks).

Values never go into a job's script, command line, logs or MLflow: backends hand them to the job through a 0600
file the job's shell sources (local processes, Docker containers, Slurm).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from blocks.errors import ConfigurationError
from blocks.values import check_env_names

if TYPE_CHECKING:
    from blocks.records import TrainingJob
import shlex
from collections.abc import Sequence


def secret_values(secrets: Mapping[str, str], field: str = "train.secrets") -> dict[str, str]:
    """``{variable: value}`` for ``{variable: Secret block name}``; a missing block is a ``ConfigurationError``."""
    if not secrets:
        return {}
    from prefect.blocks.system import Secret

    out = {}
    for env, block in secrets.items():
        try:
            value = cast(Secret, Secret.load(block)).get()  # sync here: Prefect types it as a coroutine too
        except ValueError as exc:
            if "Unable to find block document" not in str(exc) and "not found" not in str(exc).lower():
                raise
            raise ConfigurationError(
                f"{field}[{env!r}] names the Prefect Secret block {block!r}, which does not exist: create it "
                f"(Prefect UI → Blocks → Secret, or `prefect block create secret`)"
            ) from None
        out[env] = value if isinstance(value, str) else str(value)
    return out


def job_secret_values(job: TrainingJob) -> dict[str, str]:
    """Every secret variable of ``job``: its workload's Secret blocks (``train.secrets``) and the values the
    pipeline hands it itself (``secret_env``: the tracking server's login)."""
    check_job_secrets(job)
    values = secret_values(job.secrets)
    values.update({name: value.get_secret_value() for name, value in job.secret_env.items()})
    return values


def check_job_secrets(job: TrainingJob) -> None:
    """A variable is either the workload's secret or one the pipeline sets, not both (no value is read)."""
    for name in sorted(set(job.secrets) & set(job.secret_env)):
        raise ConfigurationError(
            f"train.secrets[{name!r}] sets a variable the pipeline sets itself (the stack's tracking block logs "
            "the job in to MLflow): remove it from the workload's secrets"
        )


def job_secret_names(job: TrainingJob) -> list[str]:
    """The names of ``job``'s secret variables (no value is read)."""
    return sorted({*job.secrets, *job.secret_env})


def write_secret_env(path: Path, values: Mapping[str, str]) -> None:
    """``values`` as the file a POSIX shell sources (``secret_env_text``), created 0600 before a byte is
    written, replaced atomically."""

    text = secret_env_text(values).encode()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(text)
    os.replace(tmp, path)


SECRET_ENV_NAME = ".secret.env"


# Sources the 0600 file named by $1 (exporting what it sets), then becomes the program: signals reach it as PID 1.
ENV_FILE_LAUNCHER = 'set -a; . "$1"; set +a; shift; exec "$@"'
LAUNCHER_NAME = "gpuferry-env"  # $0: how the shell names itself in its errors


def secret_env_text(values: Mapping[str, str]) -> str:
    """The 0600 file's text: ``NAME='value'`` lines a POSIX shell sources (values quoted, never evaluated)."""
    check_env_names(list(values), "secret variable")
    for name, value in values.items():
        if "\x00" in value:
            raise ConfigurationError(f"the value of {name} holds a NUL byte, which no environment variable can")
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in sorted(values.items()))


def with_env_file(command: Sequence[str], path: str) -> tuple[str, ...]:
    """``command`` run after the variables of the file at ``path`` are exported (see the module's docstring)."""
    return ("sh", "-c", ENV_FILE_LAUNCHER, LAUNCHER_NAME, path, *command)
