"""How a workload's command is launched: the interpreter behind a leading ``python``, torchrun for several
processes. Pure: shared by the compute backends (``blocks/local/compute.py``, ``blocks/slurm/script.py``)."""

from __future__ import annotations

from blocks.errors import ConfigurationError


def is_python(program: str) -> bool:
    """Whether argv[0] names a Python interpreter (``python``, ``python3.11``, ``/opt/venv/bin/python``)."""
    name = program.rsplit("/", 1)[-1]
    return name == "python" or (name.startswith("python") and name[6:].replace(".", "").isdigit())


def launch_command(command: list[str], python: str, processes: int) -> list[str]:
    """The job's argv: a leading ``python`` becomes ``python`` (the interpreter to use); more than one process
    runs under torchrun (``python -m torch.distributed.run``; a program that is not Python with ``--no-python``)."""
    if not command:
        raise ConfigurationError("the training command is empty: set train.command in gpuferry.yaml")
    python_program = command[0] == "python" or is_python(command[0])
    if command[0] == "python":
        command = [python, *command[1:]]
    if processes == 1:
        return list(command)
    torchrun = [
        command[0] if python_program else python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
    ]
    return [*torchrun, *command[1:]] if python_program else [*torchrun, "--no-python", *command]
