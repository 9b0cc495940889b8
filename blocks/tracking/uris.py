"""What a tracking URI names: an MLflow server, or a store on this machine (pure, and light: it imports no MLflow)."""

from __future__ import annotations


def is_server(uri: str | None) -> bool:
    """True for the URI of an MLflow server (http(s)), False for a local store."""
    return uri is not None and uri.startswith(("http://", "https://"))
