"""A canary or a shadow on one Docker host: the service's front sends a share of the requests to the new version
(canary), or a copy of a share of them while clients get the serving version's answers (shadow), for a window;
then the two versions' own ``/metrics`` (and, for a shadow, the front's comparison of their answers) decide
(``blocks/base/analysis.py``).

``DockerCanary`` is a part of ``DockerServing`` (a mixin). The new version is ready and answered the smoke request
when it starts; the front is told both versions and their weights (``python -m runtime.front set old=0.9
new=0.1``). A version that passes goes on as any deploy does (the front moves to it alone, the old one drains);
one that fails is taken out of the front at once, drains its requests under way and is removed, and
``CanaryFailed`` carries what was measured. A shadow's copies stop at the window's end either way.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from blocks.base.analysis import CandidateGone, Sample, decided, run_window
from blocks.base.log import run_logger
from blocks.errors import CanaryFailed, ConfigurationError, DeployFailed
from blocks.specs import RolloutPolicy

if TYPE_CHECKING:
    from blocks.docker.engine import Engine


class CanaryHost(Protocol):
    """What the canary needs of ``DockerServing``: its engine, its drain time, the front's target setter."""

    drain_seconds: int

    def engine(self) -> Engine: ...

    def front_name(self, service: str) -> str: ...

    def _set_target(self, front: str, *targets: str) -> None: ...

    def _front_command(self, front: str, *args: str) -> str: ...


if TYPE_CHECKING:
    _Base = CanaryHost
else:
    _Base = object  # the type checker's view of the block; a plain mixin here


def metrics_of(url: str, what: str) -> Sample:
    """The counters of the server at ``url``; ``DeployFailed`` naming ``what`` when it does not answer."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise DeployFailed(f"{what} did not answer {url}/metrics: {exc}") from exc
    return Sample.parse(response.text)


class DockerCanary(_Base):
    def _canary(
        self,
        service: str,
        policy: RolloutPolicy,
        *,
        serving: tuple[str, str, str],
        candidate: tuple[str, str, str, str],
    ) -> dict[str, Any]:
        """Judge the candidate by a share of the live traffic. ``serving``: (version, front target, URL) of the
        version serving now; ``candidate``: (version, front target, URL, container). What was measured when it
        passed (with ``window_ended``: give it to ``decided`` once the front moved); ``CanaryFailed`` (the
        candidate stopped and the front back on the serving version, ``decision_s`` measured) when not."""
        log = run_logger("gpuferry.docker.canary")  # the Prefect run's log inside one
        old_version, old_target, old_url = serving
        version, target, url, container = candidate
        front = self.front_name(service)
        kind = policy.strategy
        if kind == "canary":
            self._set_target(front, f"{old_target}={1 - policy.share:g}", f"{target}={policy.share:g}")
            log.info(
                "v%s of %s answers %g of the requests for %g s", version, service, policy.share, policy.window_seconds
            )

            def current() -> Sample:
                return metrics_of(old_url, f"v{old_version} (serving)")

            def back() -> None:
                self._set_target(front, old_target)

        else:  # shadow: the front copies requests to it and compares the answers; clients get the serving one's
            self._front_command(
                front,
                "shadow",
                f"http://{target}/invocations",
                f"{policy.share:g}",
                f"{policy.rtol:g}",
                f"{policy.atol:g}",
            )
            log.info(
                "v%s of %s gets a copy of %g of the requests for %g s",
                version,
                service,
                policy.share,
                policy.window_seconds,
            )

            def current() -> Sample:
                return metrics_of(old_url, f"v{old_version} (serving)") + Sample.parse(
                    self._front_command(front, "stats")
                )

            def back() -> None:
                self._front_command(front, "shadow", "off")

        def candidate_sample() -> Sample:
            try:
                return metrics_of(url, f"v{version} (the {kind})")
            except DeployFailed as exc:
                raise CandidateGone(str(exc)) from None

        def publish(state: dict[str, Any] | None) -> None:
            # What `gpuferry rollout status` shows, kept beside the front's target; `promote`/`abort` are read back.
            self._front_command(front, "rollout", *(("set", json.dumps(state)) if state else ("clear",)))

        try:
            numbers, reasons = run_window(
                policy,
                service=service,
                version=version,
                serving_version=old_version,
                current=current,
                candidate=candidate_sample,
                publish=publish,
                decision=lambda: self._front_command(front, "rollout", "decision").strip() or None,
                log=log,
            )
        except BaseException:
            back()
            raise
        if kind == "shadow":
            back()  # no more copies: passed, it takes over as in a rolling deploy; failed, it is removed
        if not reasons:
            return numbers
        back()  # every request that starts from now goes to the serving version alone
        decided(numbers)
        self.engine().stop(container, timeout=self.drain_seconds)  # those under way on the canary finish
        raise CanaryFailed(
            f"v{version} of {service} failed its {kind} and was removed, v{old_version} serves every request: "
            + "; ".join(reasons),
            version=version,
            serving_version=old_version,
            reasons=reasons,
            numbers=numbers,
        )

    def _end_stale_window(self, service: str, serving_target: str) -> None:
        """A window a deploy left under way (its process killed): the front back on the serving version alone, no
        copies, no state. A front without windows (made by an older gpuferry) has none to end."""
        front = self.front_name(service)
        if self.engine().inspect(front) is None:
            return
        try:
            stale = self.rollout_status(service)
        except DeployFailed:
            return
        if stale is not None:
            run_logger("gpuferry.docker.canary").warning(
                "%s: ending the %s of v%s that a deploy left under way",
                service,
                stale.get("strategy"),
                stale.get("version"),
            )
            self._set_target(front, serving_target)
            self._front_command(front, "shadow", "off")
            self._front_command(front, "rollout", "clear")

    def rollout_status(self, service: str) -> dict[str, Any] | None:
        """The canary or shadow window under way for ``service`` (what its deploy last wrote), or None."""
        text = self._front_command(self.front_name(service), "rollout", "show").strip()
        return json.loads(text) if text else None

    def decide_rollout(self, service: str, decision: str) -> None:
        """End the window under way now: ``promote`` (it passes) or ``abort`` (it fails and is removed)."""
        if self.rollout_status(service) is None:
            raise ConfigurationError(f"no canary or shadow window is under way for {service!r}")
        self._front_command(self.front_name(service), "rollout", "decide", decision)
