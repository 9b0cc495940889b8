"""What the parts of ``SlurmCluster`` use of one another and of the block's fields, for the type checker.

``SlurmCluster`` is one block made of parts, each a mixin in a file of its own (``transport``, ``submit``, ``jobs``,
``containers``, ``arrays``, ``housekeeping``). A part calls methods another part defines and reads the block's
fields; the type checker reads each part as a ``SlurmHost`` (``class SlurmJobs(SlurmHost)`` under
``TYPE_CHECKING``; a plain class at run time), so a call to a method no part has, or with the wrong arguments,
is an error there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from prefect_docker.credentials import DockerRegistryCredentials
    from pydantic import SecretStr

    from blocks.records import JobHandle, TrainingJob


class SlurmHost(Protocol):
    """The fields and methods of ``SlurmCluster`` its parts rely on (see the module's docstring)."""

    # The block's fields.
    workdir_root: str | None
    code_root: str | None
    adopt_lookback_days: int
    container_runtime: Literal["auto", "pyxis", "podman", "apptainer"]
    container_mounts: list[str]
    container_runtime_env: dict[str, str]
    podman_gpu_mode: Literal["cdi", "env"]
    podman_options: list[str]
    registry_credentials: DockerRegistryCredentials | None
    # Its private state.
    _lock: Any
    _shipped_code: dict[tuple[Any, ...], dict[str, float]]
    _last_jobs: tuple[float, list[dict[str, Any]]]
    _detected_runtime: tuple[tuple[Any, ...], str] | None

    @property
    def backend_name(self) -> str: ...

    # transport.py
    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        retry: bool = True,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> tuple[int, str, str]: ...

    def _read(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes | None: ...

    def _write(self, path: str, data: bytes, mode: int) -> None: ...

    def _mkdir(self, path: str) -> None: ...

    def _put_files(
        self,
        workdir: str,
        files: Mapping[str, tuple[bytes, int]],
        *,
        keep_existing: bool = False,
        then: Sequence[str] = (),
        check: bool = True,
        retry: bool = True,
    ) -> tuple[int, str, str]: ...

    def _raise_for(self, argv: Sequence[str], rc: int, message: str) -> None: ...

    def _size(self, path: str) -> int: ...

    # cluster.py
    @property
    def _cluster_key(self) -> tuple[Any, ...]: ...

    def job_workdir(self, key: str) -> str: ...

    def validate_job(self, job: TrainingJob) -> None: ...

    def _check_partition(self, partition: str | None) -> None: ...

    def _workdir_ok(self, workdir: str) -> None: ...

    def _common_options(self) -> dict[str, Any]: ...

    def _script_for_job(
        self, job: TrainingJob, *, array_size: int | None = None, parallelism: int | None = None
    ) -> str: ...

    # submit.py
    def code_dir(self, sha256: str) -> str: ...

    def ship_code(self, job: TrainingJob) -> str | None: ...

    def _secret_env(self, job: TrainingJob) -> dict[str, SecretStr]: ...

    def _submit(
        self,
        key: str,
        workdir: str,
        script: str,
        *,
        array: bool,
        hold: bool = False,
        secret_env: Mapping[str, SecretStr] | None = None,
        secret_files: Mapping[str, bytes] | None = None,
    ) -> JobHandle: ...

    # jobs.py
    def _squeue(self, job_ids: Iterable[str] = ()) -> list[dict[str, Any]]: ...

    def remove_job_secrets(self, handle: JobHandle) -> None: ...

    # containers.py
    def _container_files(self, job: TrainingJob) -> dict[str, bytes]: ...
