"""Judging a new version by live traffic: its servers' own ``/metrics`` read at the start and at the end of a
window, compared with the version serving now over the same window.

What every serving backend shares for canary and shadow rollouts: the counters gpuferry's model server exposes
(``runtime/metrics.py``, ``runtime/shadow.py``) parsed into a ``Sample``, the difference of two samples a
``Window``, and ``judge``, which applies a ``RolloutPolicy``'s gates to the two versions' windows and gives a
``Verdict`` with the numbers it measured. Nothing here talks to a server: the backends fetch the text.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from blocks.base.log import RunProgress
from blocks.specs import RolloutPolicy

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Sample:
    """The counters of one server (or several replicas', added) at one moment."""

    requests: dict[str, float] = field(default_factory=dict)  # /invocations answers by status code
    latency: dict[float, float] = field(default_factory=dict)  # cumulative buckets: upper bound → count
    shadow_rows: dict[str, float] = field(default_factory=dict)  # agree / disagree
    shadow_requests: dict[str, float] = field(default_factory=dict)  # copies by the shadow's status code
    routed: dict[str, float] = field(default_factory=dict)  # requests a server sent to a canary, by its answer

    @classmethod
    def parse(cls, text: str) -> Sample:
        """The counters of a ``/metrics`` body (Prometheus text); other series are left out."""
        sample = cls()
        for line in text.splitlines():
            match = _LINE.match(line.strip())
            if not match:
                continue
            name, labels, raw = match.groups()
            value = float(raw)
            label = dict(_LABEL.findall(labels or ""))
            if name == "inference_requests_total" and "code" in label:
                sample.requests[label["code"]] = value
            elif name == "inference_request_duration_seconds_bucket" and "le" in label:
                sample.latency[math.inf if label["le"] == "+Inf" else float(label["le"])] = value
            elif name == "inference_shadow_rows_total" and "result" in label:
                sample.shadow_rows[label["result"]] = value
            elif name == "inference_shadow_requests_total" and "code" in label:
                sample.shadow_requests[label["code"]] = value
            elif name == "inference_route_requests_total" and "code" in label:
                sample.routed[label["code"]] = value
        return sample

    def __add__(self, other: Sample) -> Sample:
        def added(a: dict[Any, float], b: dict[Any, float]) -> dict[Any, float]:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}

        return Sample(
            added(self.requests, other.requests),
            added(self.latency, other.latency),
            added(self.shadow_rows, other.shadow_rows),
            added(self.shadow_requests, other.shadow_requests),
            added(self.routed, other.routed),
        )

    def __sub__(self, earlier: Sample) -> Window:
        """What happened between ``earlier`` and this sample (a server that restarted meanwhile counts from 0)."""

        def delta(now: dict[Any, float], then: dict[Any, float]) -> dict[Any, float]:
            restarted = any(now.get(k, 0.0) < v for k, v in then.items())
            return dict(now) if restarted else {k: v - then.get(k, 0.0) for k, v in now.items()}

        return Window(
            delta(self.requests, earlier.requests),
            delta(self.latency, earlier.latency),
            delta(self.shadow_rows, earlier.shadow_rows),
            delta(self.shadow_requests, earlier.shadow_requests),
            delta(self.routed, earlier.routed),
        )


@dataclass
class Window(Sample):
    """The counts of one window."""

    @property
    def answered(self) -> int:
        return int(sum(self.requests.values()))

    @property
    def errors(self) -> int:
        """Answers that are not 2xx. A model that raises on an input answers 400 (as MLflow's server does), so a
        request the serving version answers and the new one does not counts against the new one; requests bad
        for either version count for both, and the gate compares the two rates."""
        return int(sum(n for code, n in self.requests.items() if not code.startswith("2")))

    @property
    def error_rate(self) -> float:
        return self.errors / self.answered if self.answered else 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the latency in seconds, interpolated in its bucket as Prometheus'
        ``histogram_quantile`` does; None without requests. Past the last finite bound: that bound."""
        bounds = sorted(self.latency)
        total = self.latency.get(math.inf, 0.0)
        if not bounds or total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound in bounds:
            count = self.latency[bound]
            if count >= rank:
                if bound == math.inf:
                    return lower
                inside = count - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, count
        return lower

    @property
    def agreement(self) -> float | None:
        """The share of compared rows that agree; None when none were compared."""
        compared = self.shadow_rows.get("agree", 0.0) + self.shadow_rows.get("disagree", 0.0)
        return self.shadow_rows.get("agree", 0.0) / compared if compared else None


@dataclass(frozen=True)
class Verdict:
    """Whether the new version passed, why not, and what was measured (names as the model version's tags)."""

    passed: bool
    reasons: list[str]
    numbers: dict[str, float]
    decision: str | None = None  # promote or abort: decided by hand before the window's end

    def summary(self) -> str:
        return "passed" if self.passed else "failed: " + "; ".join(self.reasons)


def judge(policy: RolloutPolicy, current: Window, candidate: Window) -> Verdict:
    """The policy's gates over one window. ``current``: the version serving now (for a shadow rollout, with its
    copies' comparisons); ``candidate``: the new version's own counts (a canary's share of the traffic, or the
    copies a shadow received). A canary's requests that the serving servers routed to it and got no answer for
    (``routed``: they answered them themselves, so the canary's own counters miss them) count as its failures."""
    unanswered = current.routed.get("none", 0.0) if policy.strategy == "canary" else 0.0
    if unanswered:
        candidate = replace(
            candidate, requests={**candidate.requests, "none": candidate.requests.get("none", 0.0) + unanswered}
        )
    numbers: dict[str, float] = {
        "current_requests": current.answered,
        "candidate_requests": candidate.answered,
        "current_error_rate": round(current.error_rate, 6),
        "candidate_error_rate": round(candidate.error_rate, 6),
    }
    for name, window in (("current", current), ("candidate", candidate)):
        p99 = window.quantile(0.99)
        if p99 is not None:
            numbers[f"{name}_p99_ms"] = round(p99 * 1000, 3)
    reasons = []
    if candidate.answered < policy.min_requests:
        reasons.append(
            f"the new version answered {candidate.answered} requests in the window, fewer than min_requests="
            f"{policy.min_requests}: too little traffic to judge (a longer window_seconds, or a lower min_requests)"
        )
    allowed = current.error_rate + policy.max_error_rate_increase
    if candidate.answered and candidate.error_rate > allowed:
        reasons.append(
            f"error rate {candidate.error_rate:.2%} against {current.error_rate:.2%} for the version serving "
            f"(max_error_rate_increase={policy.max_error_rate_increase:g})"
        )
    mine, theirs = current.quantile(0.99), candidate.quantile(0.99)
    if mine is not None and theirs is not None:
        limit = mine * policy.max_p99_ratio + policy.p99_slack_ms / 1000
        if theirs > limit:
            reasons.append(
                f"p99 latency {theirs * 1000:.1f} ms against {mine * 1000:.1f} ms for the version serving "
                f"(max_p99_ratio={policy.max_p99_ratio:g}, p99_slack_ms={policy.p99_slack_ms:g})"
            )
    if policy.strategy == "shadow":
        agreement = current.agreement
        compared = current.shadow_rows.get("agree", 0.0) + current.shadow_rows.get("disagree", 0.0)
        numbers["compared_rows"] = compared
        copies = sum(current.shadow_requests.values())
        unanswered = current.shadow_requests.get("none", 0.0)
        numbers["unanswered_copies"] = unanswered
        if copies and unanswered / copies > policy.max_error_rate_increase:
            reasons.append(
                f"{unanswered:.0f} of {copies:.0f} copies got no answer from the new version in time "
                f"(max_error_rate_increase={policy.max_error_rate_increase:g})"
            )
        if agreement is None:
            reasons.append("no answers of the two versions could be compared in the window")
        else:
            numbers["agreement"] = round(agreement, 6)
            if agreement < policy.min_agreement:
                reasons.append(
                    f"{agreement:.1%} of {compared:.0f} rows agree with the version serving "
                    f"(min_agreement={policy.min_agreement:g})"
                )
    return Verdict(passed=not reasons, reasons=reasons, numbers=numbers)


def observe(
    policy: RolloutPolicy,
    current: Callable[[], Sample],
    candidate: Callable[[], Sample],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    tick: float = 1.0,
    progress: Callable[[float, Window], None] | None = None,
    every: float = 10.0,
    control: Callable[[], str | None] | None = None,
) -> Verdict:
    """Watch one window: sample both versions, wait ``window_seconds`` (or until the new version answered
    ``window_requests``), sample them again and judge. ``progress`` gets the seconds gone and the new version's
    counts so far every ``every`` seconds; ``control``, asked every tick, may end the window with a decision
    taken by hand (``promote``: it passes, ``abort``: it fails). The verdict's numbers say how long it was."""
    first_current, first_candidate = current(), candidate()
    started = reported = clock()
    decision = None
    while (left := policy.window_seconds - (clock() - started)) > 0:
        sleep(min(tick, left))
        decision = control() if control is not None else None
        if decision in ("promote", "abort"):
            break
        decision = None
        wanted = policy.window_requests is not None
        due = progress is not None and clock() - reported >= every
        if wanted or due:
            so_far = candidate() - first_candidate
            if due and progress is not None:
                reported = clock()
                progress(reported - started, so_far)
            if policy.window_requests is not None and so_far.answered >= policy.window_requests:
                break
    verdict = judge(policy, current() - first_current, candidate() - first_candidate)
    verdict.numbers["window_seconds"] = round(clock() - started, 3)
    if decision == "promote":
        return Verdict(passed=True, reasons=[], numbers=verdict.numbers, decision=decision)
    if decision == "abort":
        reasons = ["aborted by hand (gpuferry rollout abort)"]
        return Verdict(passed=False, reasons=reasons, numbers=verdict.numbers, decision=decision)
    return verdict


class CandidateGone(Exception):
    """The new version stopped answering during its window: that is its verdict."""


def run_window(
    policy: RolloutPolicy,
    *,
    service: str,
    version: str,
    serving_version: str,
    current: Callable[[], Sample],
    candidate: Callable[[], Sample],
    publish: Callable[[dict[str, Any] | None], None],
    decision: Callable[[], str | None],
    log: Any,
    **observing: Any,
) -> tuple[dict[str, Any], list[str]]:
    """One canary or shadow window as a deploy runs it, whatever routes the traffic: its state published for
    ``gpuferry rollout status`` (``publish``; None at the end), a decision by hand read every second
    (``decision``), the progress logged every 10 s and shown on the Prefect run as the progress artifact
    ``rollout-<service>`` (the share of the window gone, the new version's answers and failures). ``observing`` goes
    to ``observe`` (a clock, a sleep). Returns what was measured (with ``window_ended``, a monotonic time:
    ``decided`` turns it into how long applying the verdict took) and the gates failed (none: it passed).
    ``candidate`` raising ``CandidateGone``: the new version stopped answering, which fails it."""
    kind = policy.strategy
    numbers: dict[str, Any] = {"strategy": kind, "share": policy.share}
    state: dict[str, Any] = {
        "service": service,
        "strategy": kind,
        "share": policy.share,
        "version": version,
        "serving_version": serving_version,
        "window_seconds": policy.window_seconds,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }

    shown = RunProgress(f"rollout-{service}", f"{kind} of v{version} beside v{serving_version}: starting")

    def progress(seconds: float, so_far: Window) -> None:
        gone = seconds / policy.window_seconds
        if policy.window_requests:
            gone = max(gone, so_far.answered / policy.window_requests)
        shown.update(
            100 * gone,
            f"{kind} of v{version}: {seconds:.0f} of {policy.window_seconds:.0f} s, {so_far.answered} requests "
            f"answered, {100 * so_far.error_rate:.1f} % failed",
        )
        log.info(
            "%s v%s: %.0f of %.0f s, %d requests answered, %.1f %% failed",
            kind,
            version,
            seconds,
            policy.window_seconds,
            so_far.answered,
            100 * so_far.error_rate,
        )
        state.update(seconds=round(seconds), answered=so_far.answered, error_rate=so_far.error_rate)
        publish(state)

    publish(None)
    publish(state)
    try:
        verdict = observe(policy, current, candidate, progress=progress, control=decision, **observing)
    except CandidateGone as exc:
        reasons = [str(exc)]
    else:
        numbers.update(verdict.numbers)
        reasons = verdict.reasons
        if verdict.decision:
            numbers["decided_by_hand"] = verdict.decision
    finally:
        publish(None)
    numbers["window_ended"] = time.monotonic()
    shown.update(
        100, f"v{version} {'failed' if reasons else 'passed'} its {kind}: " + ("; ".join(reasons) or _shown(numbers))
    )
    if not reasons:
        log.info("v%s of %s passed its %s: %s", version, service, kind, numbers)
    return numbers, reasons


_SHOWN = (
    "candidate_requests",
    "candidate_error_rate",
    "current_error_rate",
    "candidate_p99_ms",
    "current_p99_ms",
    "agreement",
)


def _shown(numbers: dict[str, Any]) -> str:
    """The verdict's main numbers, as the progress artifact shows them."""
    return ", ".join(f"{k}={numbers[k]}" for k in _SHOWN if numbers.get(k) is not None)


def decided(numbers: dict[str, Any]) -> None:
    """Replace the window's end (a monotonic time) by the seconds from it until now: the verdict applied."""
    numbers["decision_s"] = round(time.monotonic() - numbers.pop("window_ended"), 3)
