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

``container=Container(...)`` runs the program inside an image pinned by digest: see
``blocks/slurm/script_image.py``.

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
from typing import Any

from blocks import values
from blocks.base.launch import is_python
from blocks.errors import ConfigurationError
from blocks.slurm.script_image import container_lines, container_option, in_container, in_container_srun
from blocks.slurm.values import ABSOLUTE_PATH, checked, refuse
from blocks.values import ENV_NAME

SLURM_NAME_LONGEST = 128  # job, partition, account and QoS names
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
    "nodes",
    "ntasks_per_node",
    "gpus_per_node",
    "gres",
    "cpus_per_task",
    "mem",
    "time",
    "partition",
    "account",
    "qos",
    "job_name",
    "comment",
    "output",
    "error",
    "open_mode",
    "array",
    "array_parallelism",
    "dependency",
    "signal",
    "requeue",
    "additional",
)
SCRIPT_OPTIONS: tuple[str, ...] = (
    "cwd",
    "env",
    "secret_env_file",
    "array_env_dir",
    "torchrun_nproc_per_node",
    "torchrun_python",
    "rdzv_port",
    "rdzv_port_span",
    "requeue_exit_code",
    "max_requeues",
    "container",
)


def _int(option: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        refuse(option, value, f"an integer from {low} to {high}")
    return value


def check_name(value: Any, option: str) -> str:
    """A job, partition, account or QoS name: no shell metacharacters, no spaces."""
    return values.check_name(value, f"sbatch option {option}", longest=SLURM_NAME_LONGEST)


def format_time(minutes: int) -> str:
    days, rest = divmod(minutes, 60 * 24)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def _directives(options: Mapping[str, Any]) -> list[str]:  # one branch per option, in order
    out: list[str] = []

    def add(name: str, value: Any = None) -> None:
        out.append(f"#SBATCH --{name}" if value is None else f"#SBATCH --{name}={value}")

    if "job_name" in options:
        add("job-name", check_name(options["job_name"], "job_name"))
    if "comment" in options:
        add("comment", checked("comment", options["comment"], _COMMENT, "1-256 of: letters, digits and _.:=,/@+-"))
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
        add("gres", checked("gres", options["gres"], _GRES, "NAME[:TYPE]:COUNT[,...], e.g. gpu:2 or gpu:a100:4"))
    if options.get("mem") is not None:
        mem = options["mem"]
        add(
            "mem",
            f"{_int('mem', mem, 1, 2**31)}M"
            if isinstance(mem, int)
            else checked("mem", mem, _MEM, "megabytes as an integer, or a size like 4G / 500M"),
        )
    if options.get("time") is not None:
        t = options["time"]
        add(
            "time",
            format_time(_int("time", t, 1, 10**7))
            if isinstance(t, int)
            else checked("time", t, _TIME, "minutes as an integer, or D-HH:MM:SS"),
        )
    for key in ("output", "error"):
        if options.get(key) is not None:
            add(
                key,
                checked(
                    key, options[key], ABSOLUTE_PATH, "an absolute path of letters, digits and _./%+@=- (no spaces)"
                ),
            )
    open_mode = options.get("open_mode", "append")
    if open_mode not in ("append", "truncate"):
        refuse("open_mode", open_mode, "'append' or 'truncate'")
    add("open-mode", open_mode)
    if options.get("array") is not None:
        array = checked("array", options["array"], _ARRAY, "indexes like 0-99, 1,3,5 or 0-15:4")
        if options.get("array_parallelism") is not None:
            array += f"%{_int('array_parallelism', options['array_parallelism'], 1, 100_000)}"
        add("array", array)
    elif options.get("array_parallelism") is not None:
        raise ConfigurationError("array_parallelism needs array (the throttle of a job array)")
    if options.get("dependency") is not None:
        add(
            "dependency",
            checked(
                "dependency",
                options["dependency"],
                _DEPENDENCY,
                "TYPE:JOBID[:JOBID...] joined by ',' or '?', e.g. afterok:123",
            ),
        )
    if options.get("signal") is not None:
        sig = options["signal"]
        m = _SIGNAL.match(sig) if isinstance(sig, str) else None
        if m is None or not (m["sig"] in _SIGNALS or m["sig"].isdigit()) or (m["secs"] and int(m["secs"]) > 65535):
            refuse("signal", sig, f"[B:]SIG[@SECONDS] with SIG one of {', '.join(_SIGNALS)}, e.g. B:USR1@90")
        add("signal", sig)
    if options.get("requeue") is not None:
        if not isinstance(options["requeue"], bool):
            refuse("requeue", options["requeue"], "True or False")
        add("requeue" if options["requeue"] else "no-requeue")
    additional = options.get("additional") or {}
    if not isinstance(additional, Mapping):
        refuse("additional", additional, "a mapping of directive name to value")
    for name in sorted(additional):
        value = additional[name]
        if name not in ADDITIONAL_DIRECTIVES:
            raise ConfigurationError(
                f"additional sbatch directive {name!r} is not in the allow-list; allowed: "
                f"{', '.join(sorted(ADDITIONAL_DIRECTIVES))} "
                f"(the main options are keywords: {', '.join(SBATCH_OPTIONS)})"
            )
        if ADDITIONAL_DIRECTIVES[name]:
            add(
                name,
                checked(
                    f"additional[{name!r}]", str(value), _DIRECTIVE_VALUE, "1-256 of: letters, digits and _.:,[]@+=/%-"
                ),
            )
        elif value is True:
            add(name)
        elif value not in (False, None):
            refuse(f"additional[{name!r}]", value, "True or False (the directive takes no value)")
    return out


# Each node's task says whether it hosts the rendezvous (torchrun reads PET_RDZV_CONF): the first node of the
# allocation does. torchrun's own guess compares the endpoint with the machine's hostname and addresses, and misses
# when NodeAddr is on another interface (an InfiniBand or cluster network): no node would host, every one would wait.
_RDZV_HOST = "bash -c {} rendezvous ".format(
    shlex.quote(
        'export PET_RDZV_CONF="is_host=$((SLURM_NODEID == 0))${PET_RDZV_CONF:+,$PET_RDZV_CONF}" '
        'GPUFERRY_CONTAINER_ENV="${GPUFERRY_CONTAINER_ENV:-} PET_RDZV_CONF"; exec "$@"'
    )
)


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
            f"unknown sbatch option(s) {', '.join(unknown)}; "
            f"valid options: {', '.join(SBATCH_OPTIONS + SCRIPT_OPTIONS)}"
        )
    if not command or not all(isinstance(a, str) and a and "\x00" not in a for a in command):
        raise ConfigurationError(f"command={list(command)!r} must be a non-empty list of non-empty strings")
    checked("workdir", workdir, ABSOLUTE_PATH, "an absolute path of letters, digits and _./%+@=- (no spaces)")
    cwd = checked(
        "cwd",
        options.get("cwd") or workdir,
        ABSOLUTE_PATH,
        "an absolute path of letters, digits and _./%+@=- (no spaces)",
    )
    container = container_option(options, workdir)
    lines = ["#!/bin/bash", *_directives(options), ""]
    lines += ["set -uo pipefail", f"cd {shlex.quote(cwd)} || exit 1"]

    env = options.get("env") or {}
    for name in sorted(env):
        if not ENV_NAME.match(name):
            refuse(f"env[{name!r}]", name, "a variable name: letters, digits and _, not starting with a digit")
        lines.append(f"export {name}={shlex.quote(str(env[name]))}")
    if options.get("secret_env_file") is not None:
        path = checked("secret_env_file", options["secret_env_file"], ABSOLUTE_PATH, "an absolute path (no spaces)")
        lines.append(f"set -a; . {shlex.quote(path)}; set +a   # secrets: sent separately, mode 0600")
    if options.get("array_env_dir") is not None:
        if options.get("array") is None:
            raise ConfigurationError("array_env_dir needs array (it holds one environment per array task)")
        path = checked("array_env_dir", options["array_env_dir"], ABSOLUTE_PATH, "an absolute path (no spaces)")
        # NAME=value words, NUL-terminated, exported as they are: no shell ever parses a value.
        lines += [
            "# This array task's own settings: the NAME=value words (NUL-separated) of <task id>.env.",
            f"mapfile -d '' -t task_env < {shlex.quote(path)}/\"$SLURM_ARRAY_TASK_ID.env\" ||",
            '  { echo "array task $SLURM_ARRAY_TASK_ID: cannot read its settings" >&2; exit 1; }',
            '[ "${#task_env[@]}" -eq 0 ] || export "${task_env[@]}"',
        ]

    if container is not None:
        gpus = bool(options.get("gpus_per_node")) or "gpu" in str(options.get("gres") or "")
        lines += container_lines(
            container,
            workdir=workdir,
            env_names=sorted(env),
            gpus=gpus,
            array_env=options.get("array_env_dir") is not None,
        )

    nproc = options.get("torchrun_nproc_per_node")
    nodes = options.get("nodes", 1)
    if nproc is None:
        launch = in_container(container, shlex.join(command), workdir)
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
            launch = in_container(container, shlex.join([*torchrun, "--standalone", *program]), workdir)
        else:
            lines += [
                "# Rendezvous on the first node of the allocation (its address as Slurm knows it).",
                'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                'head_addr=$(scontrol show node "$head_node" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
                "export MASTER_ADDR=${head_addr:-$head_node}",
                "# One port per job: jobs sharing their first node must not meet in one rendezvous.",
                f"export MASTER_PORT=$(({port} + SLURM_JOB_ID % {span}))",
            ]
            srun_options, in_image = in_container_srun(container, workdir)
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
    secret_files = [
        path
        for path in (options.get("secret_env_file"), container.auth_file if container else None)
        if path is not None
    ]
    if secret_files and options.get("array") is None:
        lines += [
            'if [ "$rc" -eq 0 ] && [ "$slurm_stopped" -eq 0 ]; then',
            f"  rm -f -- {shlex.join(secret_files)}   # the job completed: its secrets go with it",
            "fi",
        ]
    lines += ['exit "$rc"', ""]
    return "\n".join(lines)
