"""The Prefect events that say something happened in the MLflow model registry.

Both bridges emit the same events: the webhook receiver (``deployments/webhook.py``) and the registry
poller for MLflow stores without webhooks (``deployments/poll_registry.py``). The deploy-model
deployment's trigger (``prefect.yaml``) matches them:

    event     mlflow.model_version.alias_set
    resource  prefect.resource.id = mlflow.model.<name>.<version>
              model, version, alias   the registry change
              stack                   the saved Stack block whose tracking is this MLflow ("" = embedded)
    payload   via ("webhook" | "poll"), delivery_id (webhook), previous_version (poll)

Event ids are derived from what identifies the change (the webhook's delivery id; the poller's
observed transition), so the Prefect server drops a resent copy of the same event.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

ALIAS_SET = "mlflow.model_version.alias_set"
VERSION_CREATED = "mlflow.model_version.created"
_NAMESPACE = uuid.UUID("6f1d4a52-6c1e-4d33-9a4c-2f3b8f1d6a10")


def resource_id(model: str, version: str) -> str:
    return f"mlflow.model.{model}.{version}"


def event_id(*parts: str) -> uuid.UUID:
    """A stable event id: the same parts give the same id, so the server drops the copy."""
    return uuid.uuid5(_NAMESPACE, "\x1f".join(parts))


def alias_set_event(
    model: str, version: str, alias: str, *, stack: str, via: str, id_parts: tuple[str, ...], **payload: Any
) -> dict[str, Any]:
    """The keyword arguments of ``emit_event`` for "``alias`` now points at ``model`` v``version``"."""
    return {
        "event": ALIAS_SET,
        "resource": {
            "prefect.resource.id": resource_id(model, str(version)),
            "prefect.resource.name": f"{model} v{version}",
            "model": model,
            "version": str(version),
            "alias": alias,
            "stack": stack or "",
        },
        "payload": {"via": via, **payload},
        "id": event_id(*id_parts),
    }


def version_created_event(
    model: str, version: str, *, stack: str, via: str, id_parts: tuple[str, ...], **payload: Any
) -> dict[str, Any]:
    return {
        "event": VERSION_CREATED,
        "resource": {
            "prefect.resource.id": resource_id(model, str(version)),
            "prefect.resource.name": f"{model} v{version}",
            "model": model,
            "version": str(version),
            "stack": stack or "",
        },
        "payload": {"via": via, **payload},
        "id": event_id(*id_parts),
    }


def emit(spec: dict[str, Any]) -> uuid.UUID:
    """Send the event to the Prefect API the environment points at; returns its id."""
    from prefect.events import emit_event

    emit_event(**spec)
    return spec["id"]


def flush() -> None:
    """Wait until every emitted event left this process (short-lived scripts)."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()


def recently_emitted(model: str, version: str, alias: str, within: timedelta) -> bool:
    """True when Prefect received an alias_set event for this model version and alias in the last ``within``."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )
    from prefect.events.schemas.events import ResourceSpecification

    since = datetime.now(UTC) - within
    flt = EventFilter(
        occurred=EventOccurredFilter(since=since),
        event=EventNameFilter(name=[ALIAS_SET]),
        resource=EventResourceFilter(id=[resource_id(model, version)], labels=ResourceSpecification({"alias": alias})),
    )
    with get_client(sync_client=True) as client:
        page = client.read_events(filter=flt, limit=1)
    return bool(page.events)
