"""MLflow → Prefect: receive MLflow model-registry webhooks, verify them, emit Prefect events.

The open-source Prefect server has no inbound webhooks, so this small HTTP receiver is the bridge.
Every request must carry MLflow's signature::

    X-MLflow-Delivery-Id: <uuid>
    X-MLflow-Timestamp:   <unix seconds>
    X-MLflow-Signature:   v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{raw_body}"))>

Unsigned or forged requests get 401 and emit nothing; a timestamp further than ``tolerance_seconds``
from now gets 401 too (a replayed old delivery); malformed headers or body get 400. A delivery seen
before (MLflow resends on failure) is acknowledged and not emitted again; its event id is derived from
the delivery id, so even a copy that reaches another receiver is dropped by the Prefect server.

Run it (the Prefect API from PREFECT_API_URL; the secret from a Prefect Secret block, a file or the
environment, never from the command line)::

    python -m deployments.webhook --port 5091 --stack my-stack --secret-block mlflow-webhook-secret
    python -m deployments.webhook --stack my-stack --register ...   # also (re)creates the MLflow webhook

``register_webhook`` creates the webhook in MLflow, or updates the one with the same name. ``--register``
logs in to MLflow as the stack's tracking block does (its ``username`` + ``password`` or ``token``; MLflow
allows admins only to manage webhooks); ``--register TRACKING_URI`` names another address of that server,
with the same login. A block without a login falls back to MLflow's own variables
(``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``), as every
``MlflowTracking`` does.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from deployments import mlflow_events

if TYPE_CHECKING:
    from blocks.tracking.mlflow import MlflowTracking

log = logging.getLogger("gpuferry.webhook")

SIGNATURE_HEADER = "x-mlflow-signature"
DELIVERY_HEADER = "x-mlflow-delivery-id"
TIMESTAMP_HEADER = "x-mlflow-timestamp"
SECRET_ENV = "GPUFERRY_WEBHOOK_SECRET"
DEFAULT_WEBHOOK_NAME = "gpuferry-prefect-bridge"
MAX_BODY_BYTES = 1 << 20


class Rejected(Exception):
    """The request is refused; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


# ---- the signature (pure) -----------------------------------------------------------------------


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` value MLflow sends for this delivery."""
    message = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(
    secret: str,
    headers: dict[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance_seconds: float = 300,
) -> str:
    """Check the request's signature and freshness; return its delivery id or raise ``Rejected``.

    ``headers`` keys are lower-case.
    """
    signature = headers.get(SIGNATURE_HEADER)
    delivery_id = headers.get(DELIVERY_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    if not signature or not delivery_id or not timestamp:
        missing = [
            h
            for h, v in ((SIGNATURE_HEADER, signature), (DELIVERY_HEADER, delivery_id), (TIMESTAMP_HEADER, timestamp))
            if not v
        ]
        raise Rejected(401, f"unsigned request: missing {', '.join(missing)}")
    if not timestamp.isdigit():
        raise Rejected(400, f"{TIMESTAMP_HEADER} is not a unix timestamp")
    if len(delivery_id) > 200:
        raise Rejected(400, f"{DELIVERY_HEADER} is too long")
    expected = sign(secret, delivery_id, timestamp, body)
    # Every v1 signature in the header is a candidate (MLflow sends one; a rotation may send several).
    candidates = [s.strip() for s in signature.split(" ") if s.strip()]
    if not any(hmac.compare_digest(expected.encode(), c.encode()) for c in candidates):
        raise Rejected(401, "signature does not match")
    skew = abs((time.time() if now is None else now) - int(timestamp))
    if skew > tolerance_seconds:
        raise Rejected(401, f"timestamp is {skew:.0f} s away from now (more than {tolerance_seconds:.0f} s)")
    return delivery_id


# ---- payload → event (pure) ---------------------------------------------------------------------


def model_selected(name: str, patterns: list[str] | None) -> bool:
    """True when ``patterns`` is empty or one of its shell-style patterns matches ``name``."""
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def event_for(
    payload: dict[str, Any], delivery_id: str, stack: str, models: list[str] | None = None
) -> dict[str, Any] | None:
    """The Prefect event of an MLflow webhook payload, or None for entities or models we do not bridge."""
    entity, action, data = payload.get("entity"), payload.get("action"), payload.get("data")
    if not isinstance(data, dict):
        raise Rejected(400, "payload has no data object")
    if not model_selected(str(data.get("name", "")), models):
        return None
    ids = ("mlflow-webhook", delivery_id)
    if (entity, action) == ("model_version_alias", "created"):
        name, alias, version = data.get("name"), data.get("alias"), data.get("version")
        if not (name and alias and version):
            raise Rejected(400, "model_version_alias payload needs name, alias and version")
        return mlflow_events.alias_set_event(
            str(name), str(version), str(alias), stack=stack, via="webhook", id_parts=ids, delivery_id=delivery_id
        )
    if (entity, action) == ("model_version", "created"):
        name, version = data.get("name"), data.get("version")
        if not (name and version):
            raise Rejected(400, "model_version payload needs name and version")
        return mlflow_events.version_created_event(
            str(name),
            str(version),
            stack=stack,
            via="webhook",
            id_parts=ids,
            delivery_id=delivery_id,
            source=data.get("source"),
            run_id=data.get("run_id"),
        )
    return None


class RecentDeliveries:
    """The last ``size`` delivery ids seen, oldest dropped first."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._seen: OrderedDict[str, None] = OrderedDict()

    def add(self, delivery_id: str) -> bool:
        """True the first time ``delivery_id`` is added."""
        if delivery_id in self._seen:
            self._seen.move_to_end(delivery_id)
            return False
        self._seen[delivery_id] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True


# ---- the HTTP receiver --------------------------------------------------------------------------


def build_app(
    secret: str,
    *,
    stack: str = "",
    models: list[str] | None = None,
    emit: Callable[[dict[str, Any]], Any] = mlflow_events.emit,
    tolerance_seconds: float = 300,
) -> Any:
    """The Starlette app: ``POST /mlflow`` receives webhooks, ``GET /healthz`` says it is up."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if not secret:
        raise ValueError("the webhook secret is empty")
    seen = RecentDeliveries()
    counts = {"accepted": 0, "emitted": 0, "duplicate": 0, "ignored": 0, "rejected": 0}

    async def receive(request: Request) -> JSONResponse:
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        client = request.client.host if request.client else "?"
        try:
            if len(body) > MAX_BODY_BYTES:
                raise Rejected(413, "body too large")
            delivery_id = verify(secret, headers, body, tolerance_seconds=tolerance_seconds)
            try:
                payload = json.loads(body)
            except ValueError as exc:
                raise Rejected(400, "body is not JSON") from exc
            if not isinstance(payload, dict):
                raise Rejected(400, "body is not a JSON object")
            spec = event_for(payload, delivery_id, stack, models)
        except Rejected as exc:
            counts["rejected"] += 1
            log.warning("rejected a webhook from %s: %s (%d)", client, exc.reason, exc.status)
            return JSONResponse({"error": exc.reason}, status_code=exc.status)
        counts["accepted"] += 1
        if spec is None:
            counts["ignored"] += 1
            return JSONResponse({"status": "ignored", "entity": payload.get("entity"), "action": payload.get("action")})
        if not seen.add(delivery_id):
            counts["duplicate"] += 1
            log.info("delivery %s seen before: not emitted again", delivery_id)
            return JSONResponse({"status": "duplicate", "event_id": str(spec["id"])})
        try:
            await run_in_threadpool(emit, spec)
        except Exception:
            # Let MLflow retry the delivery: forget it so the retry is emitted.
            seen._seen.pop(delivery_id, None)
            log.exception("could not emit the event of delivery %s", delivery_id)
            return JSONResponse({"error": "could not emit the Prefect event"}, status_code=503)
        counts["emitted"] += 1
        log.info("delivery %s → %s %s", delivery_id, spec["event"], spec["resource"]["prefect.resource.id"])
        return JSONResponse({"status": "emitted", "event": spec["event"], "event_id": str(spec["id"])})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", **counts})

    return Starlette(routes=[Route("/mlflow", receive, methods=["POST"]), Route("/healthz", healthz)])


# ---- the secret and the MLflow side -------------------------------------------------------------


def load_secret(block: str | None = None, file: str | None = None, env: str = SECRET_ENV) -> str:
    """The shared webhook secret: a Prefect Secret block, else a file, else ``$GPUFERRY_WEBHOOK_SECRET``."""
    if block:
        from prefect.blocks.system import Secret

        value = cast(Secret, Secret.load(block)).get()  # sync here: Prefect types it as a coroutine too
    elif file:
        value = Path(file).read_text().strip()
    else:
        value = os.environ.get(env, "")
    if not value:
        where = f"Secret block {block!r}" if block else f"file {file}" if file else f"${env}"
        raise ValueError(f"the webhook secret is empty ({where}): set it there (a long random string)")
    return str(value)


def register_webhook(tracking: MlflowTracking, url: str, secret: str, name: str = DEFAULT_WEBHOOK_NAME) -> str:
    """Create the MLflow webhook that calls ``url``, or update the one called ``name``; returns its id.
    ``tracking``: the MLflow server and its login."""
    from mlflow.entities.webhook import WebhookEvent

    client = tracking.client
    events = [WebhookEvent("model_version_alias", "created"), WebhookEvent("model_version", "created")]
    existing = find_webhook(tracking, name)
    if existing is not None:
        client.update_webhook(existing.webhook_id, url=url, events=events, secret=secret, status="ACTIVE")
        return existing.webhook_id
    return client.create_webhook(name=name, url=url, events=events, secret=secret).webhook_id


def find_webhook(tracking: MlflowTracking, name: str = DEFAULT_WEBHOOK_NAME) -> Any | None:
    """The MLflow webhook called ``name``, or None."""
    client = tracking.client
    page_token = None
    while True:
        page = client.list_webhooks(max_results=100, page_token=page_token)
        found = next((w for w in page if w.name == name), None)
        if found is not None or not page.token:
            return found
        page_token = page.token


def unregister_webhook(tracking: MlflowTracking, name: str = DEFAULT_WEBHOOK_NAME) -> bool:
    """Delete the MLflow webhook called ``name``; True if there was one."""
    found = find_webhook(tracking, name)
    if found is None:
        return False
    tracking.client.delete_webhook(found.webhook_id)
    return True


def stack_tracking(stack: str, tracking_uri: str | None = None) -> MlflowTracking:
    """The tracking block of the saved Stack block ``stack`` ('' = the embedded stack), at ``tracking_uri``
    when given (another address of the same server: the block's login goes with it)."""
    from blocks.stack import load_stack
    from blocks.tracking.uris import is_server

    tracking = load_stack(stack or None).tracking
    if tracking_uri:
        tracking = tracking.model_copy(update={"tracking_uri": tracking_uri, "registry_uri": None})
    if not is_server(tracking.tracking_uri):
        raise ValueError(
            f"--register: the tracking_uri of stack {stack or '(embedded)'!r} is {tracking.tracking_uri!r}, a local "
            "store without webhooks: point the stack's tracking at an MLflow server, or poll the registry "
            "(deployments/poll_registry.py)"
        )
    return tracking


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5091)
    parser.add_argument("--stack", default="", help="saved Stack block whose MLflow this is ('' = embedded)")
    parser.add_argument("--secret-block", help="Prefect Secret block holding the webhook secret")
    parser.add_argument("--secret-file", help="file holding the webhook secret")
    parser.add_argument("--model", action="append", help="only models matching this pattern (repeatable; default all)")
    parser.add_argument("--webhook-name", default=DEFAULT_WEBHOOK_NAME, help="name of the webhook in MLflow")
    parser.add_argument("--tolerance-seconds", type=float, default=300)
    parser.add_argument(
        "--register",
        metavar="TRACKING_URI",
        nargs="?",
        const="",
        help="create/update the webhook first, in the MLflow of --stack's tracking block and with its "
        "login (TRACKING_URI: another address of that server)",
    )
    parser.add_argument("--public-url", help="URL MLflow calls (default http://HOST:PORT/mlflow)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    secret = load_secret(args.secret_block, args.secret_file)
    if args.register is not None:
        url = args.public_url or f"http://{args.host}:{args.port}/mlflow"
        webhook_id = register_webhook(stack_tracking(args.stack, args.register), url, secret, args.webhook_name)
        log.info("MLflow webhook %s calls %s", webhook_id, url)

    import uvicorn

    uvicorn.run(
        build_app(secret, stack=args.stack, models=args.model, tolerance_seconds=args.tolerance_seconds),
        host=args.host,
        port=args.port,
        log_level="warning",
    )
    mlflow_events.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
