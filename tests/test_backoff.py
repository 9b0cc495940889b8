"""The one poll interval and retry delay every waiting loop uses (blocks/base/backoff.py)."""

from __future__ import annotations

import time

import pytest

from blocks.base.backoff import Poll, retry_delay, wait_until


def test_the_interval_starts_fast_and_grows_to_its_ceiling() -> None:
    poll = Poll(0.2, 2.0)
    assert [round(poll.next_interval(), 4) for _ in range(8)] == [0.2, 0.3, 0.45, 0.675, 1.0125, 1.5188, 2.0, 2.0]
    doubling = Poll(0.5, 5.0, factor=2)
    assert [doubling.next_interval() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 5.0]


def test_no_sleep_runs_past_the_deadline() -> None:
    poll = Poll(10.0, 10.0, timeout=0.3)
    assert not poll.expired() and 0 < poll.remaining() <= 0.3
    started = time.monotonic()
    poll.wait()  # 10 s asked, cut at the deadline
    assert time.monotonic() - started < 5 and poll.expired() and poll.remaining() == 0
    assert Poll(1.0, 1.0).remaining() == float("inf") and not Poll(1.0, 1.0).expired()


def test_bad_settings_are_refused_and_a_ceiling_below_the_start_keeps_the_start() -> None:
    for first, factor in ((0, 1.5), (1, 0.5)):
        with pytest.raises(ValueError, match="need first > 0 and factor >= 1"):
            Poll(first, 2, factor=factor)
    fixed = Poll(0.25, 0.2)
    assert [fixed.next_interval() for _ in range(3)] == [0.25, 0.25, 0.25]


def test_wait_until() -> None:
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3, 30, first=0.01, most=0.02)
    assert len(calls) == 3
    assert not wait_until(lambda: False, 0.2, first=0.05, most=0.05)


def test_retry_delay_doubles_to_a_cap_with_jitter() -> None:
    assert [retry_delay(a, 0.5, jitter=False) for a in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    for attempt in range(1, 7):
        delay = retry_delay(attempt, 0.5)
        full = retry_delay(attempt, 0.5, jitter=False)
        assert full / 2 <= delay <= full
