"""What every module of the ``gpuferry`` command shares: the default work pool and its option, how a command fails
(one or two lines naming the setting and the fix, the exit code, no traceback unless ``--debug``) and the console
tables are printed on."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from blocks.errors import ConfigurationError, GpuferryError

# The work pool the deployments run on (prefect.yaml's); GPUFERRY_WORK_POOL or --pool chooses another.
DEFAULT_POOL = "gpuferry"
PoolOption = Annotated[str, typer.Option("--pool", envvar="GPUFERRY_WORK_POOL", help="Work pool of the deployments.")]
StackOption = Annotated[str | None, typer.Option("--stack", "-s", help="A saved stack (none: embedded).")]


# Set by the --debug option (or GPUFERRY_DEBUG=1): a failure then shows its traceback too.
DEBUG = {"on": os.environ.get("GPUFERRY_DEBUG", "") not in ("", "0", "false")}


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def unreachable(exc: BaseException) -> str | None:
    """A failure to reach one of the servers a command talks to, as one or two lines that name the setting and
    the fix; None for any other error."""
    import httpx

    def text(e: BaseException) -> str:
        return " ".join((str(e) or type(e).__name__).split())[:300]

    if isinstance(exc, httpx.TransportError):
        url = str(exc.request.url) if getattr(exc, "_request", None) is not None else ""
        from prefect.settings import PREFECT_API_URL

        api = PREFECT_API_URL.value() or ""
        if not url or (api and url.startswith(api.rstrip("/").rsplit("/api", 1)[0])):
            return (
                f"cannot reach the Prefect server at {api or '(none set)'}: {text(exc)}\n"
                "Fix: start it (`prefect server start`), or point PREFECT_API_URL at yours "
                "(`prefect config set PREFECT_API_URL=http://HOST:4200/api`)"
            )
        return f"cannot reach {url}: {text(exc)}\nFix: is that server up, and reachable from here?"
    name = type(exc).__name__
    module = type(exc).__module__
    if module.startswith("prefect") and name == "PrefectHTTPStatusError":
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        if status in (401, 403):
            return (
                f"the Prefect server refused this client (HTTP {status})\n"
                "Fix: set PREFECT_API_KEY (or the server's auth string)"
            )
    if module.startswith("botocore") and name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError"):
        return f"cannot reach the S3 store: {text(exc)}\nFix: the stack's storage endpoint_url, and the network to it"
    if module.startswith("requests") and name in ("ConnectionError", "ConnectTimeout", "ReadTimeout"):
        return (
            f"cannot reach a server: {text(exc)}\n"
            "Fix: its URL in the stack (MLflow: tracking.tracking_uri), and the network to it"
        )
    if module.startswith("mlflow") and "Max retries exceeded" in str(exc):
        return f"cannot reach the MLflow server: {text(exc)}\nFix: the stack's tracking.tracking_uri, and the network"
    return None


def explained(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose errors the blocks explain, or that cannot reach a server, ends with the message (exit 2 for
    bad input, else 1), no traceback (``--debug`` shows it)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GpuferryError as exc:
            if DEBUG["on"]:
                raise
            raise fail(str(exc), 2 if isinstance(exc, ConfigurationError) else 1) from None
        except Exception as exc:
            message = unreachable(exc)
            if message is None or DEBUG["on"]:
                raise
            raise fail(message, 1) from None

    return wrapper


def console() -> Any:
    from rich.console import Console

    # Piped output (CI, a test) gets wide lines instead of rich's 80 columns.
    return Console(width=None if sys.stdout.isatty() else 220, highlight=False, soft_wrap=False)
