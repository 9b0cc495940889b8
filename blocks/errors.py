"""Errors raised by the blocks.

Blocks say *what* went wrong; the tasks decide what is worth retrying (``tasks/retry.py``).
Every message names what failed and what to do about it.
"""

from __future__ import annotations

from runtime.contract import EXIT_PREEMPTED


class GpuferryError(Exception):
    """Base of every error the blocks raise on purpose."""


class TransientError(GpuferryError):
    """The outside system failed in a way that a later attempt may not (connection, 5xx, throttling)."""


class ConfigurationError(GpuferryError, ValueError):
    """The request cannot work as given; retrying will not help. The message names the field and the fix."""


class JobFailed(GpuferryError):
    """A training job ended in a terminal failure."""

    def __init__(self, message: str, *, state: str, exit_code: int | None = None, log_tail: str = "") -> None:
        detail = f"{message}\n--- last lines of the job's log ---\n{log_tail}" if log_tail else message
        super().__init__(detail)
        self.state = state
        self.exit_code = exit_code
        self.log_tail = log_tail


class ChecksumMismatch(GpuferryError):
    """A stored object does not match the sha256 its manifest records."""


class DeployFailed(GpuferryError):
    """A new version of the inference service did not become ready; traffic stayed on the old one."""


class RolledBack(DeployFailed):
    """The new version failed to roll out and was rolled back automatically: the previous one serves again."""

    def __init__(self, message: str, *, failed_version: str, rolled_back_to: str, reason: str) -> None:
        super().__init__(message)
        self.failed_version = failed_version
        self.rolled_back_to = rolled_back_to
        self.reason = reason


class CanaryFailed(DeployFailed):
    """A new version judged by live traffic (canary or shadow) did not pass: it was removed, the version serving
    before serves every request again. ``numbers``: what the window measured; ``reasons``: the gates it failed."""

    def __init__(
        self, message: str, *, version: str, serving_version: str, reasons: list[str], numbers: dict[str, float]
    ):
        super().__init__(message)
        self.version = version
        self.serving_version = serving_version
        self.reasons = reasons
        self.numbers = numbers


def explain_exit_code(exit_code: int | None) -> str:
    """An actionable sentence for a training process's exit code."""
    if exit_code is None:
        return "the job ended without an exit code (its node failed or it was killed from outside)"
    if exit_code == EXIT_PREEMPTED:
        return "the job was preempted and saved a checkpoint; it resumes when requeued (max_requeues reached?)"
    if exit_code in (137, -9):
        return "the job was killed (SIGKILL), most often for running out of memory: give it more memory (mem_gb)"
    if exit_code in (139, -11):
        return "the job crashed with a segmentation fault (often a CUDA/driver or library mismatch)"
    if exit_code in (143, -15):
        return "the job was terminated (SIGTERM) before it could save a checkpoint"
    if exit_code == 2:
        return "the job rejected its arguments or hyperparameters (exit code 2): see the log"
    return f"the job failed with exit code {exit_code}: see the log"
