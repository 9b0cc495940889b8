"""Slurm jobs inside the workload's image: which container runtime the cluster's nodes have, the job's
container settings for the script, and the registry login it pulls with.

``SlurmContainers`` is a mixin of ``SlurmCluster``: it reads the block's container fields
(``container_runtime``, ``container_mounts``, ``container_runtime_env``, ``podman_gpu_mode``,
``podman_options``, ``registry_credentials``) and asks the login node once per cluster for "auto". The
login goes in a 0600 file next to the script in the runtime's own format (podman's and apptainer's
``--authfile``, enroot's netrc for pyxis), never into the script.
"""

from __future__ import annotations

import base64
import json
import posixpath
from typing import TYPE_CHECKING, Any

from blocks.base.secrets import job_secret_names
from blocks.errors import ConfigurationError
from blocks.records import TrainingJob
from blocks.slurm.script_image import CONTAINER_RUNTIMES, Container
from blocks.values import check_pinned_image, registry_parts

REGISTRY_AUTH_NAME = ".registry-auth.json"  # podman / apptainer --authfile
ENROOT_CREDENTIALS_NAME = ".enroot/.credentials"  # pyxis: enroot reads ENROOT_CONFIG_PATH/.credentials


if TYPE_CHECKING:
    from blocks.slurm.host import SlurmHost
else:
    SlurmHost = object  # the type checker's view of the block (blocks/slurm/host.py); a plain mixin here


class SlurmContainers(SlurmHost):
    """The image side of a ``SlurmCluster``'s jobs (see the module's docstring)."""

    # Mixed into SlurmCluster: its fields, its run() and _cluster_key, its _lock and _detected_runtime.

    def job_container_runtime(self) -> str:
        """The runtime jobs with an image use: ``container_runtime``, or for "auto" what the login node has
        (asked once per cluster): pyxis when ``srun --help`` lists ``--container-image``, else podman, else
        apptainer."""
        if self.container_runtime != "auto":
            return self.container_runtime
        where = self._cluster_key
        with self._lock:
            if self._detected_runtime is not None and self._detected_runtime[0] == where:
                return self._detected_runtime[1]
            _, out, err = self.run(["srun", "--help"], check=False)
            if "--container-image" in out + err:
                found = "pyxis"
            else:
                _, out, _ = self.run(["sh", "-c", "command -v podman; command -v apptainer; true"], check=False)
                names = {posixpath.basename(line.strip()) for line in out.splitlines()}
                found = next((r for r in ("podman", "apptainer") if r in names), "")
            if not found:
                raise ConfigurationError(
                    "the job has an image but the cluster has no container runtime: `srun --help` lists no "
                    "--container-image (pyxis) and neither podman nor apptainer is on the login node's PATH. "
                    f"Install one on the nodes, or set container_runtime to one of {', '.join(CONTAINER_RUNTIMES)}"
                )
            self._detected_runtime: tuple[tuple[Any, ...], str] | None = (where, found)
            return found

    def _container_for_job(self, job: TrainingJob) -> Container | None:
        if job.image is None or not job.image.reference:
            return None
        runtime = self.job_container_runtime()
        auth = None
        if self.registry_credentials is not None:
            auth = posixpath.join(job.workdir, ENROOT_CREDENTIALS_NAME if runtime == "pyxis" else REGISTRY_AUTH_NAME)
        return Container(
            image=check_pinned_image(job.image.reference, "job.image.reference"),
            runtime=runtime,  # type: ignore[arg-type]
            mounts=tuple(self.container_mounts),
            auth_file=auth,
            runtime_env=dict(self.container_runtime_env),
            env_names=tuple(job_secret_names(job)),
            workdir=job.image.workdir,
            gpu_mode=self.podman_gpu_mode,
            podman_options=tuple(self.podman_options),
        )

    def _container_files(self, job: TrainingJob) -> dict[str, bytes]:
        """The registry login for the job's pull, in the runtime's format: sent with mode 0600, never in the script."""
        creds = self.registry_credentials
        if self._container_for_job(job) is None or creds is None:
            return {}
        _, registry = registry_parts(creds.registry_url)
        user, password = creds.username, creds.password.get_secret_value()
        if self.job_container_runtime() == "pyxis":
            if any(c.isspace() for c in user + password):
                raise ConfigurationError(
                    "registry_credentials: enroot's .credentials (netrc) cannot hold a username or password with "
                    "whitespace; use a registry token without spaces"
                )
            line = f"machine {registry.split(':')[0]} login {user} password {password}\n"
            return {ENROOT_CREDENTIALS_NAME: line.encode()}
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {REGISTRY_AUTH_NAME: json.dumps({"auths": {registry: {"auth": token}}}).encode()}
