"""``gpuferry serve MODEL``: a model on this machine, behind gpuferry's model server, in the foreground.

As ``mlflow models serve`` does, with MLflow's scoring protocol (``POST /invocations``, ``/ping``, ``/health``,
``/version``), and with what gpuferry's server adds (``/readyz``, ``/metrics``, micro-batching, the checkpoint's
sha256 checked). MODEL is a registered model (the version ``--version`` names, else the one ``--alias`` points
at, in the stack's MLflow) or a stored checkpoint: an ``s3://`` URI of the stack's store, or a local directory
holding an MLflow model. The server reads a registered version's checkpoint from the stack's store with the
store's credentials in its environment (never on its command line) and refuses a checkpoint whose manifest is not
the one the version records. This process becomes the server (exec): Ctrl-C or SIGTERM stops it, draining what
it accepted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from blocks.errors import ConfigurationError
from deployments.cli_common import StackOption, explained
from runtime import contract

RUNTIME_PARENT = Path(contract.__file__).resolve().parent.parent  # the directory holding `runtime`


def server_environment(
    model_uri: str, *, host: str, port: int, device: str, sha256: str | None, store_env: dict[str, str]
) -> dict[str, str]:
    """The server's environment: this one's, the store's credentials and the contract's settings."""
    env = {**os.environ, **store_env}
    env.update(
        {
            contract.MODEL_URI: model_uri,
            contract.HOST: host,
            contract.PORT: str(port),
            contract.MODEL_DEVICE: device,
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["PYTHONPATH"] = str(RUNTIME_PARENT)  # gpuferry's model server is the `runtime` package there
    env.pop(contract.MODEL_SHA256, None)
    if sha256:
        env[contract.MODEL_SHA256] = sha256
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def resolve(
    model: str, version: str | None, alias: str, stack: str | None
) -> tuple[str, str | None, str, dict[str, str]]:
    """(checkpoint URI, its recorded sha256, what it is in words, the store's reader environment) of MODEL."""
    from blocks.stack import load_stack

    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "MLmodel").is_file():
            raise ConfigurationError(f"{model}: no MLmodel in it; give a directory holding an MLflow model")
        return str(local.resolve()), None, f"the MLflow model in {local.resolve()}", {}
    blocks = load_stack(stack)
    store_env = {key: value.get_secret_value() for key, value in blocks.storage.reader_env().items()}
    if "://" in model:
        return model, None, f"the checkpoint {model}", store_env
    if version is not None and not version.isdigit():
        raise ConfigurationError(f"--version {version!r}: give a version number, e.g. --version 3")
    resolved, source = blocks.tracking.resolve_version(model, version, None if version else alias)
    tags = blocks.tracking.version_tags(model, resolved)
    how = f"v{resolved}" if version else f"v{resolved} (alias {alias!r})"
    return source, tags.get("checkpoint_sha256"), f"{model} {how}, checkpoint {source}", store_env


@explained
def serve(
    model: Annotated[
        str,
        typer.Argument(
            help="A registered model's name, an s3:// checkpoint of the stack's store, or a directory with an MLflow "
            "model."
        ),
    ],
    version: Annotated[str | None, typer.Option(help="The version to serve (none: the one --alias points at).")] = None,
    alias: Annotated[str, typer.Option(help="The alias whose version is served when no --version is given.")] = (
        "champion"
    ),
    stack: StackOption = None,
    host: Annotated[str, typer.Option(help="The address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="The port to listen on.")] = 8080,
    device: Annotated[str, typer.Option(help="Where the model runs: auto, cpu, cuda or cuda:N.")] = "auto",
) -> None:
    """Serve a model on this machine in the foreground, with MLflow's scoring protocol (POST /invocations).

    Example: `gpuferry serve house-prices --stack hpc --port 5000`, then `curl -d @input.json -H
    'Content-Type: application/json' localhost:5000/invocations`.
    """
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigurationError(f"--device {device!r}: give auto, cpu, cuda or cuda:N")
    uri, sha256, what, store_env = resolve(model, version, alias, stack)
    env = server_environment(uri, host=host, port=port, device=device, sha256=sha256, store_env=store_env)
    typer.echo(f"serving {what} at http://{host}:{port} (POST /invocations; Ctrl-C stops it)", err=True)
    server = str(RUNTIME_PARENT / "runtime" / "serve.py")
    os.chdir(RUNTIME_PARENT)
    os.execve(sys.executable, [sys.executable, server], env)
