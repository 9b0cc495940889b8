"""A batch script's container: the job's program run inside the workload's image, pinned by digest.

``Container`` is what ``sbatch_script``'s ``container`` option takes (``SlurmContainers`` builds it from the
block's fields). This module checks it and writes the script's part of it: the runtime's set-up lines and the
launch inside the image, with pyxis (``srun --container-image``), podman or apptainer. The job's directory is
mounted at the same path, so checkpoints and progress land on the shared filesystem as without a container.
The backends check a job's image with ``check_pinned_image``; ``PODMAN_OPTIONS`` lists what
``SlurmCluster.podman_options`` may hold. Nothing here talks to a cluster.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from blocks import values
from blocks.slurm.values import ABSOLUTE_PATH, checked, refuse
from blocks.values import ENV_NAME

CONTAINER_RUNTIMES: tuple[str, ...] = ("pyxis", "podman", "apptainer")
# The `podman run` options a job's container may add, name -> the values allowed (None: a flag without one).
# Anything that widens what the container may touch (--privileged, --volume, --device, --cap-add, --network,
# seccomp or apparmor off) is not in here: mounts are container_mounts, GPUs come from Slurm's allocation.
PODMAN_OPTIONS: dict[str, re.Pattern[str] | None] = {
    "--pid": re.compile(r"^host$"),  # several "nodes" on one host (tests), torchrun's agents told apart
    "--ipc": re.compile(r"^(host|private|shareable)$"),  # PyTorch's DataLoader workers share memory
    "--shm-size": re.compile(r"^\d{1,9}[bkmg]?$"),
    "--ulimit": re.compile(r"^(memlock|nofile|nproc|stack|core)=-?\d{1,12}(:-?\d{1,12})?$"),
    "--security-opt": re.compile(r"^label=(disable|type:[a-z0-9_]{1,64})$"),  # SELinux nodes
    "--userns": re.compile(r"^(keep-id|host)$"),
    "--user": re.compile(r"^[a-z0-9_.-]{1,32}(:[a-z0-9_.-]{1,32})?$"),
    "--group-add": re.compile(r"^(keep-groups|[a-z0-9_.-]{1,32})$"),
    "--init": None,
    "--read-only": None,
}


@dataclass(frozen=True)
class Container:
    """Run the job's program inside ``image`` (pinned by digest) with ``runtime``.

    * ``mounts``: host paths mounted at the same path inside (the job's workdir always is);
    * ``auth_file``: registry credentials the caller sent with mode 0600 — podman/apptainer: a
      ``containers-auth.json`` (``--authfile``); pyxis: enroot's netrc-style ``.credentials`` (its
      directory becomes ``ENROOT_CONFIG_PATH``). Never written into the script;
    * ``runtime_env``: variables for the runtime itself (``CONTAINERS_CONF``, ``ENROOT_ALLOW_HTTP``...),
      exported before it runs; not passed into the container by podman;
    * ``env_names``: more variables the container gets besides ``env`` (e.g. the names of secrets);
    * ``workdir``: where the program runs inside the image (the workload's code); None: the image's
      own working directory (podman, pyxis; apptainer needs it);
    * ``podman_options``: more ``podman run`` options from ``PODMAN_OPTIONS``, ``--name[=value]`` (e.g.
      ``--security-opt=label=disable``, ``--ipc=host``); any other is refused, listing those;
    * ``gpu_mode`` (podman): ``cdi`` adds ``--device nvidia.com/gpu=<id>`` for each GPU Slurm allocated
      (``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``) and numbers them 0..n-1 in ``CUDA_VISIBLE_DEVICES``;
      ``env`` only passes ``CUDA_VISIBLE_DEVICES`` through (the devices reach the container otherwise).

    pyxis and apptainer hand the job's environment to the container themselves; podman gets each
    variable by name (``--env NAME``: the value comes from the batch shell's environment, so no value,
    secret or not, is ever on a command line).
    """

    image: str
    runtime: Literal["pyxis", "podman", "apptainer"]
    mounts: tuple[str, ...] = ()
    auth_file: str | None = None
    runtime_env: Mapping[str, str] = field(default_factory=dict)
    env_names: tuple[str, ...] = ()
    workdir: str | None = None
    gpu_mode: Literal["cdi", "env"] = "cdi"
    podman_options: tuple[str, ...] = ()


def _podman_option(option: Any) -> None:
    name, eq, value = option.partition("=") if isinstance(option, str) else ("", "", "")
    if name not in PODMAN_OPTIONS:
        refuse(
            "container.podman_options",
            option,
            f"one of {', '.join(sorted(PODMAN_OPTIONS))} (options that widen what "
            "the container may reach are not allowed: mounts go in container_mounts, GPUs come from Slurm)",
        )
    pattern = PODMAN_OPTIONS[name]
    if pattern is None and eq:
        refuse("container.podman_options", option, f"{name} without a value")
    if pattern is not None and not pattern.match(value):
        refuse("container.podman_options", option, f"{name}=VALUE with VALUE matching {pattern.pattern}")


def _pyxis_image(reference: str) -> str:
    """enroot's form of a reference: the registry host is separated by '#' (``host:port#repo@digest``)."""
    first, _, rest = reference.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return reference


def container_option(options: Mapping[str, Any], workdir: str) -> Container | None:
    c = options.get("container")
    if c is None:
        return None
    if not isinstance(c, Container):
        refuse("container", c, "a blocks.slurm.script_image.Container")
    if c.runtime not in CONTAINER_RUNTIMES:
        refuse("container.runtime", c.runtime, f"one of {', '.join(CONTAINER_RUNTIMES)}")
    values.check_pinned_image(c.image, "container.image")
    if c.gpu_mode not in ("cdi", "env"):
        refuse("container.gpu_mode", c.gpu_mode, "'cdi' or 'env'")
    for option in c.podman_options:
        _podman_option(option)
    for mount in c.mounts:
        checked("container.mounts", mount, ABSOLUTE_PATH, "absolute paths of letters, digits and _./%+@=- (no spaces)")
    if c.workdir is not None:
        checked("container.workdir", c.workdir, ABSOLUTE_PATH, "an absolute path inside the image (no spaces)")
    elif c.runtime == "apptainer":
        refuse(
            "container.workdir",
            None,
            "the directory of the workload's code inside the image (apptainer does not "
            "start in the image's WORKDIR): declare image.workdir in gpuferry.yaml",
        )
    if c.auth_file is not None:
        checked("container.auth_file", c.auth_file, ABSOLUTE_PATH, "an absolute path (no spaces)")
        if c.runtime == "pyxis" and not c.auth_file.endswith("/.credentials"):
            refuse(
                "container.auth_file",
                c.auth_file,
                "a file named .credentials (enroot reads ENROOT_CONFIG_PATH/.credentials)",
            )
    for name in [*c.runtime_env, *c.env_names]:
        if not isinstance(name, str) or not ENV_NAME.match(name):
            refuse("container variable name", name, "a variable name: letters, digits and _, not starting with a digit")
    return c


def container_lines(c: Container, *, workdir: str, env_names: Sequence[str], gpus: bool, array_env: bool) -> list[str]:
    """The script lines that prepare the runtime; podman and apptainer get an ``in_image`` function."""
    mounts = [workdir, *(m for m in c.mounts if m != workdir)]
    lines = [
        f"# Run the program inside the image ({c.runtime}), pinned by digest; the job's directory and the"
        " mounts at the same paths."
    ]
    for name in sorted(c.runtime_env):
        lines.append(f"export {name}={shlex.quote(str(c.runtime_env[name]))}")
    if c.runtime == "pyxis":
        if c.auth_file:
            lines.append(
                f"export ENROOT_CONFIG_PATH={shlex.quote(c.auth_file.rsplit('/', 1)[0])}"
                "   # registry credentials, mode 0600"
            )
        return lines
    if c.runtime == "podman":
        names = sorted({*env_names, *c.env_names})
        lines += [
            "# The container gets these variables by name (podman --env NAME): "
            "their values never reach a command line.",
            f"export GPUFERRY_CONTAINER_ENV={shlex.quote(' '.join(names))}",
        ]
        if array_env:
            lines.append('for word in "${task_env[@]}"; do GPUFERRY_CONTAINER_ENV+=" ${word%%=*}"; done')
        args = ["--rm", "--network=host", "--pull=missing"]
        if c.auth_file:
            args.append(f"--authfile={c.auth_file}")
        args += [f"--volume={m}:{m}" for m in mounts]
        args += [*([f"--workdir={c.workdir}"] if c.workdir else []), "--env=SLURM_*"]
        if c.gpu_mode == "env":
            args.append("--env=CUDA_VISIBLE_DEVICES")
        args += c.podman_options
        lines += [
            "in_image() {",
            f"  local args=({' '.join(shlex.quote(a) for a in args)}) name",
            '  for name in $GPUFERRY_CONTAINER_ENV; do args+=("--env=$name"); done',
        ]
        if c.gpu_mode == "cdi":
            lines += [
                "  # The GPUs Slurm allocated on this node (global ids), numbered 0..n-1 inside the container.",
                '  local gpu visible="" n=0 gpus=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}',
                '  for gpu in ${gpus//,/ }; do args+=("--device=nvidia.com/gpu=$gpu"); '
                'visible+="${visible:+,}$n"; n=$((n + 1)); done',
                '  [ -z "$visible" ] || args+=("--env=CUDA_VISIBLE_DEVICES=$visible")',
            ]
        lines += [f'  exec podman run "${{args[@]}}" {shlex.quote(c.image)} "$@"', "}"]
        return lines
    args = ["exec"]
    if c.auth_file:
        args.append(f"--authfile={c.auth_file}")
    args += [f"--bind={m}:{m}" for m in mounts]
    args.append(f"--pwd={c.workdir}")
    if gpus:
        args.append("--nv")
    lines += [
        "in_image() {",
        f'  exec apptainer {" ".join(shlex.quote(a) for a in args)} {shlex.quote("docker://" + c.image)} "$@"',
        "}",
    ]
    return lines


def _pyxis_options(c: Container, workdir: str) -> str:
    mounts = [workdir, *(m for m in c.mounts if m != workdir)]
    return shlex.join(
        [
            f"--container-image={_pyxis_image(c.image)}",
            "--container-mounts=" + ",".join(f"{m}:{m}" for m in mounts),
            *([f"--container-workdir={c.workdir}"] if c.workdir else []),
        ]
    )


def in_container(c: Container | None, launch: str, workdir: str) -> str:
    """``launch`` (a command run by the batch shell itself) run inside the container."""
    if c is None:
        return launch
    if c.runtime == "pyxis":
        return f"srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 {_pyxis_options(c, workdir)} {launch}"
    return f"in_image {launch}"


def in_container_srun(c: Container | None, workdir: str) -> tuple[str, str]:
    """(extra srun options, the prefix of the command srun runs) for a launch through srun."""
    if c is None:
        return "", ""
    if c.runtime == "pyxis":
        return f" {_pyxis_options(c, workdir)}", ""
    # srun runs a fresh bash on each node: it gets the function's text (names and paths only).
    return "", 'bash -c "$(declare -f in_image)"\'; in_image "$@"\' in_image '
