"""Poll an MLflow registry for alias changes and emit the same events as the webhook receiver.

For MLflow stores without webhooks (a file store, an older server, a managed service that does not
send them). Each poll is one paged ``search_registered_models`` call: it lists every model's aliases;
an alias that now points at another version emits ``mlflow.model_version.alias_set``.

What it last saw is kept in a JSON state file, so a restart emits the changes made while it was down
and nothing else. The first poll with no state file only records what it sees (``--emit-initial``
emits it too). When the webhook receiver runs as well, a change it already reported (an alias_set
event for the same model version and alias within ``dedupe_window``) is not emitted again; should both
still report it, deploy-model runs one at a time and deploying the serving version changes nothing.

    python -m deployments.poll_registry --stack my-stack --interval 10
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deployments import mlflow_events
from deployments.webhook import model_selected

log = logging.getLogger("gpuferry.poll_registry")


def changes(
    before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]
) -> list[tuple[str, str, str, str | None]]:
    """``(model, alias, version, previous_version)`` for every alias that is new or moved (pure)."""
    out = []
    for model, aliases in sorted(after.items()):
        for alias, version in sorted(aliases.items()):
            previous = before.get(model, {}).get(alias)
            if previous != version:
                out.append((model, alias, version, previous))
    return out


class RegistryPoller:
    """Watches one MLflow registry (the tracking block of a stack) for alias changes."""

    def __init__(
        self,
        read_aliases: Callable[[], dict[str, dict[str, str]]],
        *,
        tracking_uri: str,
        stack: str = "",
        state_file: str | Path | None = None,
        aliases: set[str] | None = None,
        models: list[str] | None = None,
        emit_initial: bool = False,
        dedupe_window: timedelta | None = timedelta(minutes=5),
        emit: Callable[[dict[str, Any]], Any] = mlflow_events.emit,
        already_emitted: Callable[[str, str, str, timedelta], bool] = mlflow_events.recently_emitted,
    ) -> None:
        self.read_aliases = read_aliases
        self.tracking_uri = tracking_uri
        self.stack = stack
        self.state_file = Path(state_file) if state_file else None
        self.aliases = aliases
        self.models = models
        self.emit_initial = emit_initial
        self.dedupe_window = dedupe_window
        self.emit = emit
        self.already_emitted = already_emitted
        self.seen: dict[str, dict[str, str]] | None = self._load()
        self.last_poll: datetime | None = None

    def _load(self) -> dict[str, dict[str, str]] | None:
        if self.state_file is None or not self.state_file.exists():
            return None
        state = json.loads(self.state_file.read_text())
        if state.get("tracking_uri") != self.tracking_uri:
            log.warning(
                "%s was written for %s, not %s: starting afresh",
                self.state_file,
                state.get("tracking_uri"),
                self.tracking_uri,
            )
            return None
        return state["aliases"]

    def _save(self) -> None:
        if self.state_file is None or self.seen is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tracking_uri": self.tracking_uri, "aliases": self.seen}, indent=1))
        os.replace(tmp, self.state_file)

    def poll_once(self) -> list[dict[str, Any]]:
        """Read the registry once; emit an event for every alias that moved. Returns the emitted events."""
        started = datetime.now(UTC)
        now = {m: a for m, a in self.read_aliases().items() if model_selected(m, self.models)}
        if self.aliases is not None:
            now = {m: {a: v for a, v in al.items() if a in self.aliases} for m, al in now.items()}
        if self.seen is None and not self.emit_initial:
            self.seen = now
            self._save()
            log.info("first poll: %d models recorded, nothing emitted", len(now))
            return []
        emitted = []
        window = self._dedupe_window(started)
        for model, alias, version, previous in changes(self.seen or {}, now):
            if window and self.already_emitted(model, version, alias, window):
                log.info("%s %s → v%s was already reported (webhook): not emitted again", model, alias, version)
                continue
            spec = mlflow_events.alias_set_event(
                model,
                version,
                alias,
                stack=self.stack,
                via="poll",
                id_parts=("mlflow-poll", self.tracking_uri, model, alias, version, previous or ""),
                previous_version=previous,
            )
            self.emit(spec)
            emitted.append(spec)
            log.info("%s %s: v%s → v%s, emitted %s", model, alias, previous, version, spec["event"])
        # Everything seen is recorded, emitted or not; a failed emit raised above and is retried next poll.
        self.seen = now
        self.last_poll = started
        self._save()
        return emitted

    def _dedupe_window(self, started: datetime) -> timedelta | None:
        """How far back a webhook's event can stand for a change this poll sees: not before the previous poll
        (which saw the old state), else an alias moved back to a version it had minutes ago is never emitted."""
        if not self.dedupe_window or self.last_poll is None:
            return self.dedupe_window
        return min(self.dedupe_window, started - self.last_poll + timedelta(seconds=5))

    def run(self, interval_seconds: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Poll every ``interval_seconds`` until ``stop()``; a failed poll is logged and retried."""
        while not stop():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # the registry or Prefect hiccuped; the next poll retries
                log.exception("poll failed; retrying in %.0f s", interval_seconds)
            time.sleep(max(0.0, interval_seconds - (time.monotonic() - started)))


def for_stack(stack: str = "", **kwargs: Any) -> RegistryPoller:
    """A poller of the MLflow registry of the saved Stack block ``stack`` ('' = the embedded stack)."""
    from blocks.stack import load_stack

    tracking = load_stack(stack or None).tracking
    return RegistryPoller(tracking.alias_map, tracking_uri=tracking.tracking_uri, stack=stack, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="", help="saved Stack block whose MLflow to poll ('' = embedded)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between polls")
    parser.add_argument("--state-file", help="where the last seen aliases are kept (default under $GPUFERRY_HOME)")
    parser.add_argument("--model", action="append", help="only models matching this pattern (repeatable; default all)")
    parser.add_argument("--alias", action="append", help="only these aliases (repeatable; default all)")
    parser.add_argument("--emit-initial", action="store_true", help="also emit what the first poll sees")
    parser.add_argument(
        "--dedupe-seconds",
        type=float,
        default=300,
        help="skip a change the webhook reported this recently (0: never skip)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from blocks.home import gpuferry_home

    state = args.state_file or gpuferry_home() / "poll-registry" / f"{args.stack or 'embedded'}.json"
    poller = for_stack(
        args.stack,
        state_file=state,
        aliases=set(args.alias) if args.alias else None,
        models=args.model,
        emit_initial=args.emit_initial,
        dedupe_window=timedelta(seconds=args.dedupe_seconds) if args.dedupe_seconds else None,
    )
    try:
        poller.run(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        mlflow_events.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
