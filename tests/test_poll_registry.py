"""The registry poller: one event per alias move, deduplicated against the webhook only since its last poll."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from deployments.poll_registry import RegistryPoller


class FakeRegistry:
    def __init__(self) -> None:
        self.aliases: dict[str, dict[str, str]] = {"digits": {"champion": "1"}}
        self.emitted: list[dict[str, Any]] = []
        # Events "already in Prefect" (as the webhook would have sent them): (model, version, alias, when).
        self.webhook_events: list[tuple[str, str, str, datetime]] = []

    def already_emitted(self, model: str, version: str, alias: str, within: timedelta) -> bool:
        since = datetime.now(UTC) - within
        return any(e[:3] == (model, version, alias) and e[3] >= since for e in self.webhook_events)

    def poller(self) -> RegistryPoller:
        return RegistryPoller(
            lambda: {m: dict(a) for m, a in self.aliases.items()},
            tracking_uri="http://mlflow.test",
            emit=self.emitted.append,
            already_emitted=self.already_emitted,
        )


def test_moves_are_emitted_once_and_webhook_events_are_not_repeated() -> None:
    reg = FakeRegistry()
    poller = reg.poller()
    assert poller.poll_once() == []  # first poll records the state
    reg.aliases["digits"]["champion"] = "2"
    reg.webhook_events.append(("digits", "2", "champion", datetime.now(UTC)))
    assert poller.poll_once() == []  # the webhook already reported v2
    assert poller.poll_once() == []  # nothing moved


def test_a_quick_rollback_is_emitted_even_though_that_version_had_an_event_minutes_ago() -> None:
    reg = FakeRegistry()
    poller = reg.poller()
    poller.poll_once()
    # v1 was champion a minute ago (an event for it exists), then v2; now the team rolls back to v1.
    reg.webhook_events.append(("digits", "1", "champion", datetime.now(UTC) - timedelta(minutes=1)))
    reg.aliases["digits"]["champion"] = "2"
    poller.poll_once()
    poller.last_poll = datetime.now(UTC) - timedelta(seconds=10)  # as after a 10 s poll interval
    reg.aliases["digits"]["champion"] = "1"
    emitted = poller.poll_once()
    assert [e["resource"]["version"] for e in emitted] == ["1"]
