"""The webhook receiver and the registry poller without any server: signatures, events, dedupe."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from deployments import mlflow_events
from deployments.poll_registry import RegistryPoller, changes
from deployments.webhook import Rejected, build_app, event_for, load_secret, sign, verify

SECRET = "s3cr3t-probe"
# A delivery as MLflow 3.17 sent it (headers and body recorded from a real server, see the notes).
DELIVERY = "1a98d97b-77b5-4288-88b0-29fadb66b31e"
TIMESTAMP = "1795973864"
BODY = (
    b'{"entity": "model_version_alias", "action": "created", '
    b'"data": {"name": "bar", "alias": "champion", "version": "1"}}'
)


def headers(delivery: str = DELIVERY, ts: str = TIMESTAMP, body: bytes = BODY, secret: str = SECRET) -> dict[str, str]:
    return {
        "x-mlflow-delivery-id": delivery,
        "x-mlflow-timestamp": ts,
        "x-mlflow-signature": sign(secret, delivery, ts, body),
    }


def test_signature_is_mlflows_v1_scheme() -> None:
    expected = base64.b64encode(
        hmac.new(SECRET.encode(), f"{DELIVERY}.{TIMESTAMP}.".encode() + BODY, hashlib.sha256).digest()
    ).decode()
    assert sign(SECRET, DELIVERY, TIMESTAMP, BODY) == "v1," + expected
    assert verify(SECRET, headers(), BODY, now=float(TIMESTAMP)) == DELIVERY


@pytest.mark.parametrize(
    ("change", "status", "reason"),
    [
        (lambda h, b: ({**h, "x-mlflow-signature": sign("wrong", DELIVERY, TIMESTAMP, b)}, b), 401, "does not match"),
        (lambda h, b: (h, b + b" "), 401, "does not match"),  # body changed after signing
        (lambda h, b: ({**h, "x-mlflow-delivery-id": "other"}, b), 401, "does not match"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "x-mlflow-signature"}, b), 401, "unsigned"),
        (lambda h, b: ({}, b), 401, "unsigned"),
        (lambda h, b: ({**h, "x-mlflow-timestamp": "yesterday"}, b), 400, "unix timestamp"),
        (lambda h, b: ({**h, "x-mlflow-signature": "v1,AAAA"}, b), 401, "does not match"),
    ],
)
def test_forged_requests_are_rejected(change: Any, status: int, reason: str) -> None:
    h, body = change(headers(), BODY)
    with pytest.raises(Rejected, match=reason) as err:
        verify(SECRET, h, body, now=float(TIMESTAMP))
    assert err.value.status == status


def test_stale_or_future_timestamps_are_rejected() -> None:
    for skew in (-301, 301, 86_400):
        with pytest.raises(Rejected, match="away from now") as err:
            verify(SECRET, headers(), BODY, now=float(TIMESTAMP) + skew, tolerance_seconds=300)
        assert err.value.status == 401
    assert verify(SECRET, headers(), BODY, now=float(TIMESTAMP) + 299, tolerance_seconds=300) == DELIVERY


def test_alias_payload_becomes_the_alias_set_event() -> None:
    spec = event_for(json.loads(BODY), DELIVERY, "team")
    assert spec is not None
    assert spec["event"] == "mlflow.model_version.alias_set"
    assert spec["resource"] == {
        "prefect.resource.id": "mlflow.model.bar.1",
        "prefect.resource.name": "bar v1",
        "model": "bar",
        "version": "1",
        "alias": "champion",
        "stack": "team",
    }
    assert spec["payload"] == {"via": "webhook", "delivery_id": DELIVERY}
    # The event id follows the delivery: a resent delivery is the same event.
    assert spec["id"] == event_for(json.loads(BODY), DELIVERY, "team")["id"]
    assert spec["id"] != event_for(json.loads(BODY), "another-delivery", "team")["id"]
    assert event_for(json.loads(BODY), DELIVERY, "team", models=["other-*"]) is None
    assert event_for(json.loads(BODY), DELIVERY, "team", models=["ba?"]) is not None
    assert event_for({"entity": "registered_model", "action": "created", "data": {"name": "bar"}}, DELIVERY, "") is None
    with pytest.raises(Rejected, match="needs name, alias and version"):
        event_for({"entity": "model_version_alias", "action": "created", "data": {"name": "bar"}}, DELIVERY, "")


def test_receiver_emits_once_per_delivery_and_never_for_forgeries() -> None:
    emitted: list[dict] = []
    app = build_app(SECRET, stack="team", emit=emitted.append)
    now = str(int(time.time()))
    with TestClient(app) as client:
        ok = client.post("/mlflow", content=BODY, headers=headers(ts=now))
        dup = client.post("/mlflow", content=BODY, headers=headers(ts=now))
        forged = client.post("/mlflow", content=BODY, headers=headers(ts=now, secret="guess"))
        unsigned = client.post("/mlflow", content=BODY)
        old = client.post("/mlflow", content=BODY, headers=headers(delivery="d2", ts=str(int(time.time()) - 3600)))
        health = client.get("/healthz").json()
    assert (ok.status_code, ok.json()["status"]) == (200, "emitted")
    assert (dup.status_code, dup.json()["status"]) == (200, "duplicate")
    assert [forged.status_code, unsigned.status_code, old.status_code] == [401, 401, 401]
    assert len(emitted) == 1 and emitted[0]["resource"]["version"] == "1"
    assert health["emitted"] == 1 and health["rejected"] == 3 and health["duplicate"] == 1


def test_receiver_lets_mlflow_retry_when_prefect_is_down() -> None:
    calls: list[dict] = []

    def failing(spec: dict) -> None:
        calls.append(spec)
        if len(calls) == 1:
            raise ConnectionError("prefect down")

    now = str(int(time.time()))
    with TestClient(build_app(SECRET, emit=failing)) as client:
        assert client.post("/mlflow", content=BODY, headers=headers(ts=now)).status_code == 503
        assert client.post("/mlflow", content=BODY, headers=headers(ts=now)).json()["status"] == "emitted"
    assert len(calls) == 2


def test_secret_is_never_empty_and_comes_from_the_file_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFERRY_WEBHOOK_SECRET", raising=False)
    with pytest.raises(ValueError, match="GPUFERRY_WEBHOOK_SECRET"):
        load_secret()
    monkeypatch.setenv("GPUFERRY_WEBHOOK_SECRET", "from-env")
    assert load_secret() == "from-env"
    (tmp_path / "s").write_text("from-file\n")
    assert load_secret(file=str(tmp_path / "s")) == "from-file"
    with pytest.raises(ValueError):
        build_app("")


def test_poller_emits_alias_moves_only(tmp_path: Path) -> None:
    assert changes({"a": {"champion": "1"}}, {"a": {"champion": "2", "canary": "3"}, "b": {}}) == [
        ("a", "canary", "3", None),
        ("a", "champion", "2", "1"),
    ]
    registry = {"m": {"champion": "1"}, "other": {"champion": "7"}}
    emitted: list[dict] = []
    reported: set[tuple[str, str, str]] = set()

    def make() -> RegistryPoller:
        return RegistryPoller(
            lambda: json.loads(json.dumps(registry)),
            tracking_uri="http://mlflow",
            stack="team",
            state_file=tmp_path / "state.json",
            models=["m"],
            emit=emitted.append,
            already_emitted=lambda m, v, a, w: (m, v, a) in reported,
        )

    poller = make()
    assert poller.poll_once() == [] and emitted == []  # first poll: baseline only
    registry["m"]["champion"] = "2"
    registry["other"]["champion"] = "8"  # not selected
    assert [e["resource"]["version"] for e in poller.poll_once()] == ["2"]
    assert emitted[0]["payload"] == {"via": "poll", "previous_version": "1"}
    assert poller.poll_once() == []  # nothing moved since
    registry["m"]["champion"] = "3"
    reported.add(("m", "3", "champion"))  # the webhook reported it already
    assert poller.poll_once() == []
    registry["m"]["champion"] = "4"
    restarted = make()  # the state file carries what was seen across a restart
    assert [e["resource"]["version"] for e in restarted.poll_once()] == ["4"]
    assert len(emitted) == 2
    # The same transition seen by two pollers is one event id.
    spec = mlflow_events.alias_set_event(
        "m",
        "4",
        "champion",
        stack="team",
        via="poll",
        id_parts=("mlflow-poll", "http://mlflow", "m", "champion", "4", "3"),
    )
    assert emitted[1]["id"] == spec["id"]
    assert mlflow_events.event_id("a", "b") != mlflow_events.event_id("ab")
