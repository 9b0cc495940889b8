"""Prometheus text metrics for the inference server, without a client library (model-agnostic).

Everything is updated on the event loop thread only, so nothing needs a lock.
"""

from __future__ import annotations

import math
from bisect import bisect_left

_LATENCY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ROWS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    """A Prometheus histogram: cumulative buckets rendered from per-bucket counts."""

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i counts values <= bounds[i]
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.9g}", f"{self.name}_count {total}"]
        return lines


def latency_histogram(name: str, help_text: str) -> Histogram:
    """A histogram of seconds with the server's latency buckets."""
    return Histogram(name, help_text, _LATENCY_BOUNDS)


class Metrics:
    """Requests by status code, request latency, rows and duration of each predict call, fallbacks."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}
        self.latency = latency_histogram(
            "inference_request_duration_seconds",
            "Time from the start of an /invocations request until its response is ready to send.",
        )
        self.batch_size = Histogram("inference_batch_size", "Rows per predict call.", _ROWS_BOUNDS)
        self.batch_requests = Histogram("inference_batch_requests", "Requests per predict call.", _ROWS_BOUNDS)
        self.predict_seconds = Histogram(
            "inference_predict_duration_seconds",
            "Time one batch spends on the predict thread (assembly, predict, encoding).",
            _LATENCY_BOUNDS,
        )
        self.fallbacks = 0

    def observe_request(self, status: int, seconds: float) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        self.latency.observe(seconds)

    def observe_batch(self, rows: int, requests: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.batch_requests.observe(requests)
        self.predict_seconds.observe(seconds)

    def render(self, queue_depth: int, ready: bool, extra: list[str] | None = None) -> bytes:
        lines = [
            "# HELP inference_requests_total /invocations requests by HTTP status code.",
            "# TYPE inference_requests_total counter",
            *(f'inference_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())),
            *self.latency.render(),
            *self.batch_size.render(),
            *self.batch_requests.render(),
            *self.predict_seconds.render(),
            "# HELP inference_batch_fallbacks_total Batches predicted again one request at a time (the batch failed,"
            " or its output did not have one row per input row).",
            "# TYPE inference_batch_fallbacks_total counter",
            f"inference_batch_fallbacks_total {self.fallbacks}",
            "# HELP inference_queue_depth Requests waiting for a predict call.",
            "# TYPE inference_queue_depth gauge",
            f"inference_queue_depth {queue_depth}",
            "# HELP inference_ready 1 when the server reports ready.",
            "# TYPE inference_ready gauge",
            f"inference_ready {int(ready)}",
            *(extra or []),
        ]
        return ("\n".join(lines) + "\n").encode()
