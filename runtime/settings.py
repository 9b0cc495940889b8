"""The inference server's settings, read once from the environment (names in ``runtime/serve.py``'s docstring)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import contract
from runtime.device import AUTO, parse_device
from runtime.shadow import ShadowSettings


@dataclass(frozen=True)
class Settings:
    """The server's configuration, read once from the environment."""

    model_uri: str
    model_name: str | None = None
    model_sha256: str | None = None  # the checkpoint's identity the model version records (MODEL_SHA256)
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch_size: int = 64
    max_batch_wait_ms: float = 2.0
    max_queue: int = 256
    max_request_rows: int = 1024
    max_request_bytes: int = 64 << 20
    drain_seconds: float = 2.0
    warmup_iterations: int = 3
    torch_threads: int | None = None
    model_device: str = AUTO  # auto, cpu, cuda or cuda:N (runtime.device)
    shadow: ShadowSettings | None = None  # where copies of requests go (runtime.shadow; SHADOW_URL unset: None)
    route_file: str | None = None  # a canary or shadow set while the server runs (runtime.route; ROUTE_FILE)

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        model_uri = env.get(contract.MODEL_URI, "")
        if not model_uri:
            raise ValueError(f"{contract.MODEL_URI} is not set: give the path, file:// or s3:// URI of a checkpoint")

        def number(name: str, default: float | None, kind: type[int] | type[float], minimum: float) -> Any:
            raw = env.get(name, "")
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
            if value < minimum or (kind is float and not math.isfinite(value)):
                raise ValueError(f"{name}={raw!r} must be a finite number of at least {minimum}")
            return value

        sha256 = env.get(contract.MODEL_SHA256, "").strip().lower() or None
        if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"{contract.MODEL_SHA256}={sha256!r} is not a sha256 (64 hex digits)")
        return cls(
            model_uri=model_uri,
            model_name=env.get("MODEL_NAME") or None,
            model_sha256=sha256,
            host=env.get(contract.HOST, "") or cls.host,
            port=number(contract.PORT, cls.port, int, 0),
            max_batch_size=number(contract.MAX_BATCH_SIZE, cls.max_batch_size, int, 1),
            max_batch_wait_ms=number(contract.MAX_BATCH_WAIT_MS, cls.max_batch_wait_ms, float, 0),
            max_queue=number(contract.MAX_QUEUE, cls.max_queue, int, 1),
            max_request_rows=number("MAX_REQUEST_ROWS", cls.max_request_rows, int, 1),
            max_request_bytes=number("MAX_REQUEST_BYTES", cls.max_request_bytes, int, 1),
            drain_seconds=number("DRAIN_SECONDS", cls.drain_seconds, float, 0),
            warmup_iterations=number("WARMUP_ITERATIONS", cls.warmup_iterations, int, 1),
            torch_threads=number("TORCH_NUM_THREADS", None, int, 1),
            model_device=parse_device(env.get(contract.MODEL_DEVICE, "")),
            shadow=ShadowSettings.from_env(env),
            route_file=env.get(contract.ROUTE_FILE, "").strip() or None,
        )


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a container's CPU limit)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus
