"""How gpuferry waits: one poll interval that starts fast and grows to a ceiling, and one retry delay.

Every loop that waits for an outside system (a job, a rollout, a container, a node, an instance) polls
through :class:`Poll`: the first check comes almost at once (a step that is already done returns at
once), the interval then grows by ``factor`` up to ``most`` (a long wait costs few requests), and no
sleep runs past the deadline. Retries of a failed request wait :func:`retry_delay`: exponential, capped,
and jittered so that many clients do not retry in step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


class Poll:
    """A poll interval from ``first`` growing by ``factor`` to ``most``; ``timeout`` (seconds) sets a deadline."""

    def __init__(self, first: float, most: float, *, factor: float = 1.5, timeout: float | None = None) -> None:
        if first <= 0 or factor < 1:
            raise ValueError(f"Poll(first={first}, factor={factor}): need first > 0 and factor >= 1")
        self.most, self.factor = max(most, first), factor  # a ceiling below the start: no growth
        self.interval = first
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def expired(self) -> bool:
        """Whether the deadline has passed (never, without a timeout)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def remaining(self) -> float:
        """Seconds left before the deadline (0 when it passed; infinite without a timeout)."""
        return float("inf") if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_interval(self) -> float:
        """The sleep the next :meth:`wait` takes (the interval, cut at the deadline), and grow the interval."""
        sleep = min(self.interval, self.remaining())
        self.interval = min(self.interval * self.factor, self.most)
        return sleep

    def wait(self) -> None:
        """Sleep the current interval (never past the deadline), then grow it."""
        time.sleep(self.next_interval())


def wait_until(condition: Callable[[], bool], timeout: float, *, first: float = 0.1, most: float = 1.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` passes (False)."""
    poll = Poll(first, most, timeout=timeout)
    while True:
        if condition():
            return True
        if poll.expired():
            return False
        poll.wait()


def retry_delay(attempt: int, base: float, *, most: float = 8.0, jitter: bool = True) -> float:
    """The wait before retry number ``attempt`` (1 = the first retry): ``base`` doubling, at most ``most``;
    with ``jitter`` a random 50–100 % of it."""
    delay = min(base * 2 ** (attempt - 1), most)
    return delay * (0.5 + random.random() / 2) if jitter else delay
