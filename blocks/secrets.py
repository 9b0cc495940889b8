"""The values of a workload's secrets, from Prefect Secret blocks (the workload file names only the blocks).

Values never go into a job's script, command line, logs or MLflow: backends hand them to the job through its
environment (a local process) or a 0600 file the job's shell sources (Slurm).
"""

from __future__ import annotations

from collections.abc import Mapping

from blocks.errors import ConfigurationError


def secret_values(secrets: Mapping[str, str], field: str = "train.secrets") -> dict[str, str]:
    """``{variable: value}`` for ``{variable: Secret block name}``; a missing block is a ``ConfigurationError``."""
    if not secrets:
        return {}
    from prefect.blocks.system import Secret

    out = {}
    for env, block in secrets.items():
        try:
            value = Secret.load(block).get()
        except ValueError as exc:
            if "Unable to find block document" not in str(exc) and "not found" not in str(exc).lower():
                raise
            raise ConfigurationError(
                f"{field}[{env!r}] names the Prefect Secret block {block!r}, which does not exist: create it "
                f"(Prefect UI → Blocks → Secret, or `prefect block create secret`)"
            ) from None
        out[env] = value if isinstance(value, str) else str(value)
    return out
