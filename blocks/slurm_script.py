"""The sbatch script of a job: one pure function, every supported option a keyword.

``sbatch_script(command, workdir=..., **options)`` returns the text of a batch script. Each option
is validated (names by pattern, numbers by range, free text by a strict character set) and an
option it does not know is an error that lists the valid ones. Values end up in ``#SBATCH`` lines
(which sbatch, not a shell, reads: they are restricted to characters that need no quoting) or in
the body, where every value is ``shlex.quote``-d. Nothing here talks to a cluster.

Secrets are never written into the script: the script only *sources* ``secret_env_file`` (a file
the caller sends separately with 0600 permissions) when that option is given. A job that completed
removes that file and the container's registry login (``auth_file``); after any other end it may be
requeued, so the caller removes them (and an array's tasks share them).

``container=Container(...)`` runs the program inside an image pinned by digest (see ``Container``):
with pyxis (``srun --container-image``), podman or apptainer. The job's directory is mounted at the
same path, so checkpoints and progress land on the shared filesystem as without a container.

Launch modes:

* a plain command (the default): runs in the batch shell, which forwards ``USR1``/``TERM`` to it so
  that a ``--signal=B:USR1@90`` warning or a preemption reaches the program;
* ``torchrun_nproc_per_node=N``: ``command`` runs under ``python -m torch.distributed.run`` (a
  ``[python, script, *args]`` command with its own interpreter, any other program with
  ``--no-python`` and ``torchrun_python``); on one node with ``--standalone``, on several with one
  ``srun`` task per node and a c10d rendezvous on the address of the first node of
  ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``, then that node's ``NodeAddr``), which that
  node's task hosts (``is_host`` by ``SLURM_NODEID``, not torchrun's guess from hostnames). The port is
  ``rdzv_port + SLURM_JOB_ID % rdzv_port_span``: two multi-node jobs that share their first node
  (several slurmd on one host, or nodes not allocated exclusively) do not meet on one port.

A program that exits with ``requeue_exit_code`` (the contract's ``EXIT_PREEMPTED``: it saved a
checkpoint on the warning signal) is requeued with ``scontrol requeue`` while
``SLURM_RESTART_COUNT`` is below ``max_requeues``, and resumes from its checkpoint. Not when the
batch shell itself got TERM: that is Slurm ending the job — a preemption (``PreemptMode=REQUEUE``
requeues it already: requeueing it here too would count a second restart), a ``scancel`` (which
must stay cancelled) or the time limit.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from blocks.errors import ConfigurationError
from blocks.launch import is_python

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
NAME_HELP = "1-128 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"
_PATH = re.compile(r"^/[A-Za-z0-9_./%+@=-]{0,1023}$")
_COMMENT = re.compile(r"^[A-Za-z0-9_.:=,/@+-]{1,256}$")
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_MEM = re.compile(r"^\d{1,9}[KMGT]?$")
_GRES = re.compile(r"^[a-z]+(:[A-Za-z0-9_.-]+)?:\d{1,4}(,[a-z]+(:[A-Za-z0-9_.-]+)?:\d{1,4})*$")
_ARRAY = re.compile(r"^\d{1,7}(-\d{1,7}(:\d{1,7})?)?(,\d{1,7}(-\d{1,7}(:\d{1,7})?)?)*$")
_DEPENDENCY = re.compile(
    r"^(singleton|(after|afterany|afterok|afternotok|aftercorr|afterburstbuffer)(:\d+(_\d+)?(\+\d+)?)+)"
    r"([,?](singleton|(after|afterany|afterok|afternotok|aftercorr|afterburstbuffer)(:\d+(_\d+)?(\+\d+)?)+))*$"
)
_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "CONT", "STOP", "KILL")
_SIGNAL = re.compile(r"^(?:(?P<where>B|R|RB|BR):)?(?:SIG)?(?P<sig>[A-Z0-9]+)(?:@(?P<secs>\d{1,5}))?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.:,\[\]@+=/%-]{1,256}$")

# Directives passed through `additional` (name -> takes a value?). Anything else is refused: an
# option that changes where output goes, who the job runs as, or its environment is not in here.
ADDITIONAL_DIRECTIVES: dict[str, bool] = {
    "constraint": True,
    "exclusive": False,
    "nodelist": True,
    "exclude": True,
    "reservation": True,
    "begin": True,
    "licenses": True,
    "mem-per-cpu": True,
    "mem-per-gpu": True,
    "gpus-per-task": True,
    "cpus-per-gpu": True,
    "gpu-bind": True,
    "hint": True,
    "distribution": True,
    "nice": True,
    "wckey": True,
    "switches": True,
    "tmp": True,
    "container-image": True,
    "container-mounts": True,
}

SBATCH_OPTIONS: tuple[str, ...] = (
    "nodes", "ntasks_per_node", "gpus_per_node", "gres", "cpus_per_task", "mem", "time", "partition",
    "account", "qos", "job_name", "comment", "output", "error", "open_mode", "array", "array_parallelism",
    "dependency", "signal", "requeue", "additional",
)  # fmt: skip
SCRIPT_OPTIONS: tuple[str, ...] = (
    "cwd", "env", "secret_env_file", "array_env_dir", "torchrun_nproc_per_node", "torchrun_python", "rdzv_port",
    "rdzv_port_span", "requeue_exit_code", "max_requeues", "container",
)  # fmt: skip

def _fail(option: str, value: Any, allowed: str) -> None:
    raise ConfigurationError(f"sbatch option {option}={value!r} is not allowed: use {allowed}")


def _check(option: str, value: Any, pattern: re.Pattern[str], allowed: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        _fail(option, value, allowed)
    return value


def _int(option: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(option, value, f"an integer from {low} to {high}")
    return value


def check_name(value: Any, option: str) -> str:
    """A job, partition, account or QoS name: no shell metacharacters, no spaces."""
    return _check(option, value, NAME, NAME_HELP)


def format_time(minutes: int) -> str:
    days, rest = divmod(minutes, 60 * 24)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def _directives(options: Mapping[str, Any]) -> list[str]:  # noqa: C901 - one branch per option, in order
    out: list[str] = []

    def add(name: str, value: Any = None) -> None:
        out.append(f"#SBATCH --{name}" if value is None else f"#SBATCH --{name}={value}")

    if "job_name" in options:
        add("job-name", check_name(options["job_name"], "job_name"))
    if "comment" in options:
        add("comment", _check("comment", options["comment"], _COMMENT, "1-256 of: letters, digits and _.:=,/@+-"))
    for key in ("partition", "account", "qos"):
        if options.get(key) is not None:
            add(key, check_name(options[key], key))
    add("nodes", _int("nodes", options.get("nodes", 1), 1, 100_000))
    if options.get("ntasks_per_node") is not None:
        add("ntasks-per-node", _int("ntasks_per_node", options["ntasks_per_node"], 1, 1024))
    if options.get("cpus_per_task") is not None:
        add("cpus-per-task", _int("cpus_per_task", options["cpus_per_task"], 1, 4096))
    if options.get("gpus_per_node") is not None and options.get("gres") is not None:
        raise ConfigurationError("set either gpus_per_node or gres, not both (both allocate GPUs)")
    if options.get("gpus_per_node"):
        add("gpus-per-node", _int("gpus_per_node", options["gpus_per_node"], 0, 64))
    if options.get("gres") is not None:
        add("gres", _check("gres", options["gres"], _GRES, "NAME[:TYPE]:COUNT[,...], e.g. gpu:2 or gpu:a100:4"))
    if options.get("mem") is not None:
        mem = options["mem"]
        add("mem", f"{_int('mem', mem, 1, 2**31)}M" if isinstance(mem, int) else
            _check("mem", mem, _MEM, "megabytes as an integer, or a size like 4G / 500M"))  # fmt: skip
    if options.get("time") is not None:
        t = options["time"]
        add("time", format_time(_int("time", t, 1, 10**7)) if isinstance(t, int) else
            _check("time", t, _TIME, "minutes as an integer, or D-HH:MM:SS"))  # fmt: skip
    for key in ("output", "error"):
        if options.get(key) is not None:
            add(key, _check(key, options[key], _PATH, "an absolute path of letters, digits and _./%+@=- (no spaces)"))
    open_mode = options.get("open_mode", "append")
    if open_mode not in ("append", "truncate"):
        _fail("open_mode", open_mode, "'append' or 'truncate'")
    add("open-mode", open_mode)
    if options.get("array") is not None:
        array = _check("array", options["array"], _ARRAY, "indexes like 0-99, 1,3,5 or 0-15:4")
        if options.get("array_parallelism") is not None:
            array += f"%{_int('array_parallelism', options['array_parallelism'], 1, 100_000)}"
        add("array", array)
    elif options.get("array_parallelism") is not None:
        raise ConfigurationError("array_parallelism needs array (the throttle of a job array)")
    if options.get("dependency") is not None:
        add("dependency", _check("dependency", options["dependency"], _DEPENDENCY,
                                 "TYPE:JOBID[:JOBID...] joined by ',' or '?', e.g. afterok:123"))  # fmt: skip
    if options.get("signal") is not None:
        sig = options["signal"]
        m = _SIGNAL.match(sig) if isinstance(sig, str) else None
        if m is None or not (m["sig"] in _SIGNALS or m["sig"].isdigit()) or (m["secs"] and int(m["secs"]) > 65535):
            _fail("signal", sig, f"[B:]SIG[@SECONDS] with SIG one of {', '.join(_SIGNALS)}, e.g. B:USR1@90")
        add("signal", sig)
    if options.get("requeue") is not None:
        if not isinstance(options["requeue"], bool):
            _fail("requeue", options["requeue"], "True or False")
        add("requeue" if options["requeue"] else "no-requeue")
    additional = options.get("additional") or {}
    if not isinstance(additional, Mapping):
        _fail("additional", additional, "a mapping of directive name to value")
    for name in sorted(additional):
        value = additional[name]
        if name not in ADDITIONAL_DIRECTIVES:
            raise ConfigurationError(
                f"additional sbatch directive {name!r} is not in the allow-list; allowed: "
                f"{', '.join(sorted(ADDITIONAL_DIRECTIVES))} (the main options are keywords: {', '.join(SBATCH_OPTIONS)})"
            )
        if ADDITIONAL_DIRECTIVES[name]:
            add(name, _check(f"additional[{name!r}]", str(value), _DIRECTIVE_VALUE,
                             "1-256 of: letters, digits and _.:,[]@+=/%-"))  # fmt: skip
        elif value is True:
            add(name)
        elif value not in (False, None):
            _fail(f"additional[{name!r}]", value, "True or False (the directive takes no value)")
    return out


# ---- running inside a container image ------------------------------------------------------

CONTAINER_RUNTIMES: tuple[str, ...] = ("pyxis", "podman", "apptainer")
# repository@sha256:<64 hex>, the repository optionally led by a registry host[:port].
_PINNED_IMAGE = re.compile(
    r"^(?P<repo>(?:[A-Za-z0-9][A-Za-z0-9.-]*(?::\d{1,5})?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)@sha256:[0-9a-f]{64}$"
)
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
PINNED_IMAGE_HELP = "REPOSITORY@sha256:<64 hex digits>, e.g. registry.example:5000/team/workload@sha256:... (an image pinned by digest)"


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
        _fail("container.podman_options", option, f"one of {', '.join(sorted(PODMAN_OPTIONS))} (options that widen what "
              "the container may reach are not allowed: mounts go in container_mounts, GPUs come from Slurm)")
    pattern = PODMAN_OPTIONS[name]
    if pattern is None and eq:
        _fail("container.podman_options", option, f"{name} without a value")
    if pattern is not None and not pattern.match(value):
        _fail("container.podman_options", option, f"{name}=VALUE with VALUE matching {pattern.pattern}")


def check_pinned_image(reference: Any, option: str = "image") -> str:
    """An image reference pinned by digest, or a ConfigurationError saying how to pin it."""
    if not isinstance(reference, str) or not _PINNED_IMAGE.match(reference):
        raise ConfigurationError(
            f"{option}={reference!r} is not pinned by digest: use {PINNED_IMAGE_HELP}; a tag can move, a digest "
            "cannot (DockerImageBuilder returns the pinned reference)"
        )
    return reference


def _pyxis_image(reference: str) -> str:
    """enroot's form of a reference: the registry host is separated by '#' (``host:port#repo@digest``)."""
    first, _, rest = reference.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return reference


def _container(options: Mapping[str, Any], workdir: str) -> Container | None:
    c = options.get("container")
    if c is None:
        return None
    if not isinstance(c, Container):
        _fail("container", c, "a blocks.slurm_script.Container")
    if c.runtime not in CONTAINER_RUNTIMES:
        _fail("container.runtime", c.runtime, f"one of {', '.join(CONTAINER_RUNTIMES)}")
    check_pinned_image(c.image, "container.image")
    if c.gpu_mode not in ("cdi", "env"):
        _fail("container.gpu_mode", c.gpu_mode, "'cdi' or 'env'")
    for option in c.podman_options:
        _podman_option(option)
    for mount in c.mounts:
        _check("container.mounts", mount, _PATH, "absolute paths of letters, digits and _./%+@=- (no spaces)")
    if c.workdir is not None:
        _check("container.workdir", c.workdir, _PATH, "an absolute path inside the image (no spaces)")
    elif c.runtime == "apptainer":
        _fail("container.workdir", None, "the directory of the workload's code inside the image (apptainer does not "
              "start in the image's WORKDIR): declare image.workdir in gpuferry.yaml")
    if c.auth_file is not None:
        _check("container.auth_file", c.auth_file, _PATH, "an absolute path (no spaces)")
        if c.runtime == "pyxis" and not c.auth_file.endswith("/.credentials"):
            _fail("container.auth_file", c.auth_file, "a file named .credentials (enroot reads ENROOT_CONFIG_PATH/.credentials)")
    for name in [*c.runtime_env, *c.env_names]:
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            _fail("container variable name", name, "a variable name: letters, digits and _, not starting with a digit")
    return c


def _container_lines(c: Container, *, workdir: str, env_names: Sequence[str], gpus: bool,
                     array_env: bool) -> list[str]:  # fmt: skip
    """The script lines that prepare the runtime; podman and apptainer get an ``in_image`` function."""
    mounts = [workdir, *(m for m in c.mounts if m != workdir)]
    lines = [f"# Run the program inside the image ({c.runtime}), pinned by digest; the job's directory and the"
             " mounts at the same paths."]  # fmt: skip
    for name in sorted(c.runtime_env):
        lines.append(f"export {name}={shlex.quote(str(c.runtime_env[name]))}")
    if c.runtime == "pyxis":
        if c.auth_file:
            lines.append(f"export ENROOT_CONFIG_PATH={shlex.quote(c.auth_file.rsplit('/', 1)[0])}   # registry credentials, mode 0600")
        return lines
    if c.runtime == "podman":
        names = sorted({*env_names, *c.env_names})
        lines += [
            "# The container gets these variables by name (podman --env NAME): their values never reach a command line.",
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
                '  for gpu in ${gpus//,/ }; do args+=("--device=nvidia.com/gpu=$gpu"); visible+="${visible:+,}$n"; n=$((n + 1)); done',
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
    return shlex.join([
        f"--container-image={_pyxis_image(c.image)}",
        "--container-mounts=" + ",".join(f"{m}:{m}" for m in mounts),
        *([f"--container-workdir={c.workdir}"] if c.workdir else []),
    ])  # fmt: skip


def _in_container(c: Container | None, launch: str, workdir: str) -> str:
    """``launch`` (a command run by the batch shell itself) run inside the container."""
    if c is None:
        return launch
    if c.runtime == "pyxis":
        return f"srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1 {_pyxis_options(c, workdir)} {launch}"
    return f"in_image {launch}"


# Each node's task says whether it hosts the rendezvous (torchrun reads PET_RDZV_CONF): the first node of the
# allocation does. torchrun's own guess compares the endpoint with the machine's hostname and addresses, and misses
# when NodeAddr is on another interface (an InfiniBand or cluster network): no node would host, every one would wait.
_RDZV_HOST = "bash -c {} rendezvous ".format(shlex.quote(
    'export PET_RDZV_CONF="is_host=$((SLURM_NODEID == 0))${PET_RDZV_CONF:+,$PET_RDZV_CONF}" '
    'GPUFERRY_CONTAINER_ENV="${GPUFERRY_CONTAINER_ENV:-} PET_RDZV_CONF"; exec "$@"'
))


def _in_container_srun(c: Container | None, workdir: str) -> tuple[str, str]:
    """(extra srun options, the prefix of the command srun runs) for a launch through srun."""
    if c is None:
        return "", ""
    if c.runtime == "pyxis":
        return f" {_pyxis_options(c, workdir)}", ""
    # srun runs a fresh bash on each node: it gets the function's text (names and paths only).
    return "", "bash -c \"$(declare -f in_image)\"'; in_image \"$@\"' in_image "


def sbatch_script(command: Sequence[str], *, workdir: str, **options: Any) -> str:
    """The batch script that runs ``command`` (an argv list) for the job that owns ``workdir``.

    sbatch options: nodes, ntasks_per_node, gpus_per_node, gres, cpus_per_task, mem (MB or '4G'),
    time (minutes or D-HH:MM:SS), partition, account, qos, job_name, comment, output, error,
    open_mode, array, array_parallelism, dependency, signal, requeue, additional (allow-listed
    directives). Script options: cwd (where the program runs; default ``workdir``), env (exported
    variables), secret_env_file (sourced, never inlined), array_env_dir (array task i exports the
    NUL-separated NAME=value words of ``<dir>/<i>.env``), torchrun_nproc_per_node, torchrun_python
    (the interpreter that runs torchrun for a command that is not ``[python, ...]``), rdzv_port and
    rdzv_port_span (the rendezvous port is rdzv_port + job id % rdzv_port_span), requeue_exit_code,
    max_requeues.
    """
    unknown = sorted(set(options) - set(SBATCH_OPTIONS) - set(SCRIPT_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown sbatch option(s) {', '.join(unknown)}; valid options: {', '.join(SBATCH_OPTIONS + SCRIPT_OPTIONS)}"
        )
    if not command or not all(isinstance(a, str) and a and "\x00" not in a for a in command):
        raise ConfigurationError(f"command={list(command)!r} must be a non-empty list of non-empty strings")
    _check("workdir", workdir, _PATH, "an absolute path of letters, digits and _./%+@=- (no spaces)")
    cwd = _check("cwd", options.get("cwd") or workdir, _PATH, "an absolute path of letters, digits and _./%+@=- (no spaces)")
    container = _container(options, workdir)
    lines = ["#!/bin/bash", *_directives(options), ""]
    lines += ["set -uo pipefail", f"cd {shlex.quote(cwd)} || exit 1"]

    env = options.get("env") or {}
    for name in sorted(env):
        if not _ENV_NAME.match(name):
            _fail(f"env[{name!r}]", name, "a variable name: letters, digits and _, not starting with a digit")
        lines.append(f"export {name}={shlex.quote(str(env[name]))}")
    if options.get("secret_env_file") is not None:
        path = _check("secret_env_file", options["secret_env_file"], _PATH, "an absolute path (no spaces)")
        lines.append(f"set -a; . {shlex.quote(path)}; set +a   # secrets: sent separately, mode 0600")
    if options.get("array_env_dir") is not None:
        if options.get("array") is None:
            raise ConfigurationError("array_env_dir needs array (it holds one environment per array task)")
        path = _check("array_env_dir", options["array_env_dir"], _PATH, "an absolute path (no spaces)")
        # NAME=value words, NUL-terminated, exported as they are: no shell ever parses a value.
        lines += [
            "# This array task's own settings: the NAME=value words (NUL-separated) of <task id>.env.",
            f"mapfile -d '' -t task_env < {shlex.quote(path)}/\"$SLURM_ARRAY_TASK_ID.env\" ||",
            '  { echo "array task $SLURM_ARRAY_TASK_ID: cannot read its settings" >&2; exit 1; }',
            '[ "${#task_env[@]}" -eq 0 ] || export "${task_env[@]}"',
        ]

    if container is not None:
        gpus = bool(options.get("gpus_per_node")) or "gpu" in str(options.get("gres") or "")
        lines += _container_lines(container, workdir=workdir, env_names=sorted(env), gpus=gpus,
                                  array_env=options.get("array_env_dir") is not None)  # fmt: skip

    nproc = options.get("torchrun_nproc_per_node")
    nodes = options.get("nodes", 1)
    if nproc is None:
        launch = _in_container(container, shlex.join(command), workdir)
    else:
        _int("torchrun_nproc_per_node", nproc, 1, 64)
        port = _int("rdzv_port", options.get("rdzv_port", 29500), 1024, 65535)
        span = _int("rdzv_port_span", options.get("rdzv_port_span", 1000), 1, 65536 - port)
        if is_python(command[0]):
            if len(command) < 2:
                raise ConfigurationError("with torchrun, a Python command is [python, script, *args]")
            python, program = command[0], list(command[1:])
            torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        else:  # any other program: torchrun starts it as it is
            python, program = options.get("torchrun_python") or "python3", list(command)
            torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--no-python"]
        if nodes == 1:
            launch = _in_container(container, shlex.join([*torchrun, "--standalone", *program]), workdir)
        else:
            lines += [
                "# Rendezvous on the first node of the allocation (its address as Slurm knows it).",
                'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                'head_addr=$(scontrol show node "$head_node" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
                "export MASTER_ADDR=${head_addr:-$head_node}",
                "# One port per job: jobs sharing their first node must not meet in one rendezvous.",
                f"export MASTER_PORT=$(({port} + SLURM_JOB_ID % {span}))",
            ]
            srun_options, in_image = _in_container_srun(container, workdir)
            launch = (
                'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
                f"--kill-on-bad-exit=1{srun_options} {_RDZV_HOST}{in_image}{shlex.join(torchrun)} "
                '--nnodes="$SLURM_JOB_NUM_NODES" --rdzv-backend=c10d --rdzv-id="$SLURM_JOB_ID" '
                f'--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" {shlex.join(program)}'
            )
    # The batch shell forwards the warning signal (--signal=B:...) and Slurm's TERM to the program.
    # A TERM to the batch shell means Slurm itself is ending the job (preemption, which Slurm
    # requeues; scancel; the time limit): the script must then not requeue the job a second time.
    lines += [
        "slurm_stopped=0",
        f"{launch} &",
        "child=$!",
        "trap 'kill -USR1 \"$child\" 2>/dev/null' USR1",
        "trap 'slurm_stopped=1; kill -TERM \"$child\" 2>/dev/null' TERM",
        'while true; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done',
    ]
    requeue_code = options.get("requeue_exit_code")
    if requeue_code is not None:
        _int("requeue_exit_code", requeue_code, 1, 255)
        max_requeues = _int("max_requeues", options.get("max_requeues", 3), 0, 1000)
        lines += [
            f'if [ "$rc" -eq {requeue_code} ] && [ "$slurm_stopped" -eq 1 ]; then',
            '  echo "exit code $rc after Slurm stopped job $SLURM_JOB_ID: Slurm requeues it if it was preempted"',
            f'elif [ "$rc" -eq {requeue_code} ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then',
            '  echo "exit code $rc: requeueing job $SLURM_JOB_ID to resume from its checkpoint"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    # A job that completed never starts again: its secrets and registry login go with it. After any other end
    # it may (a preemption or a node failure is requeued): the orchestrator removes them once it knows (cancel,
    # result). An array's tasks share them.
    secret_files = [path for path in (options.get("secret_env_file"), container.auth_file if container else None)
                    if path is not None]  # fmt: skip
    if secret_files and options.get("array") is None:
        lines += [
            'if [ "$rc" -eq 0 ] && [ "$slurm_stopped" -eq 0 ]; then',
            f"  rm -f -- {shlex.join(secret_files)}   # the job completed: its secrets go with it",
            "fi",
        ]
    lines += ['exit "$rc"', ""]
    return "\n".join(lines)
