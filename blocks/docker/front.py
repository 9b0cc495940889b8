"""A Docker service's front: the container at the service's fixed address that forwards to the version serving now.

``DockerFront`` is a part of ``DockerServing`` (a mixin): it makes the front when there is none that fits the
block's settings (network, address, port), points it at a new version's container (``python -m runtime.front
set``, inside it) and waits until the version answers through it; a failure points it back. The front itself is
``runtime/front.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from blocks.base.backoff import wait_until
from blocks.base.serving import is_ready
from blocks.docker.spec import FRONT_COMMAND, FRONT_PORT_IN_CONTAINER, LABEL_KIND, LABEL_SERVICE, front_container
from blocks.errors import DeployFailed

if TYPE_CHECKING:
    from blocks.docker.engine import Engine


class FrontHost(Protocol):
    """What the front needs of ``DockerServing``: its engine, its settings, where a container is published."""

    network: str
    bind_address: str
    service_port: int | None
    restart_policy: str
    front_ready_seconds: float

    def engine(self) -> Engine: ...

    def front_name(self, service: str) -> str: ...

    def _url(self, info: dict[str, Any], port: int | None = None) -> str | None: ...


if TYPE_CHECKING:
    _Base = FrontHost
else:
    _Base = object  # the type checker's view of the block; a plain mixin here


class DockerFront(_Base):
    def _route(self, service: str, target: str, image: str, readiness: str, *, restore: str | None) -> str:
        """Point the service's front at ``target`` (making the front when there is none that fits) and wait until
        it answers ``readiness`` through to it: the front's URL. On failure the front goes back to ``restore``
        (a front made here is removed)."""
        engine = self.engine()
        name = self.front_name(service)
        info = engine.inspect(name)
        if info is not None and not self._front_fits(info):
            engine.remove(info["Id"])  # gone astray (stopped, or another network or port): made again
            info = None
        made, front = info is None, None
        try:
            if info is None:
                spec = front_container(
                    name=name,
                    image=image,
                    target=target,
                    labels={LABEL_KIND: "front", LABEL_SERVICE: service},
                    network=self.network,
                    bind_address=self.bind_address,
                    host_port=self.service_port,
                    restart_policy=self.restart_policy,
                )
                front = engine.create(spec)
                engine.start(front)
                info = engine.inspect(front)
            else:
                front = info["Id"]
                self._set_target(front, target)
            url = self._url(info, FRONT_PORT_IN_CONTAINER) if info is not None else None
            ended: list[str] = []

            def answers() -> bool:
                if url is not None and is_ready(url, readiness):
                    return True
                now = engine.inspect(front)
                if now is None or now["State"]["Status"] in ("exited", "dead"):
                    ended.append(f"exited with code {now['State'].get('ExitCode')}" if now else "vanished")
                return url is None or bool(ended)  # nothing more to wait for

            if not wait_until(answers, self.front_ready_seconds, most=0.5) or url is None or ended:
                tail = engine.tail(front, 20) or ""
                why = (
                    ended[0]
                    if ended
                    else "has no published port"
                    if url is None
                    else (
                        f"did not answer {readiness} through to {target} within {self.front_ready_seconds:.0f} s "
                        "(front_ready_seconds)"
                    )
                )
                raise DeployFailed(f"the service's front {name} {why}\n--- last lines of the front's log ---\n{tail}")
        except BaseException as exc:
            if made and front is not None:
                engine.remove(front)
            elif front is not None and restore is not None:
                try:
                    self._set_target(front, restore)
                except Exception as again:  # noqa: BLE001 - the first failure is the one to raise
                    exc.add_note(f"pointing the front back at {restore} failed too: {again}")
            raise
        return url

    def _set_target(self, front: str, *targets: str) -> None:
        """Point the front at ``targets`` (``host:port``, or ``host:port=weight`` each of several)."""
        code, output = self.engine().exec(front, [*FRONT_COMMAND, "set", *targets])
        if code != 0:
            hint = (
                " (a front made by an older gpuferry splits no traffic: remove its container to have it made again)"
                if len(targets) > 1
                else ""
            )
            raise DeployFailed(
                f"the service's front refused the target {' '.join(targets)} (exit {code}): "
                f"{output.strip()[-500:]}{hint}"
            )

    def _front_command(self, front: str, *args: str) -> str:
        """``python -m runtime.front ARGS`` in the front's container (its shadow, its counts): the output."""
        code, output = self.engine().exec(front, [*FRONT_COMMAND, *args])
        if code != 0:
            raise DeployFailed(
                f"the service's front refused `{' '.join(args[:1])}` (exit {code}): {output.strip()[-500:]} (a front "
                "made by an older gpuferry copies no requests: remove its container to have it made again)"
            )
        return output

    def _front_fits(self, info: dict[str, Any]) -> bool:
        """The front is running, on this block's network, published where this block says."""
        networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
        bound = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{FRONT_PORT_IN_CONTAINER}/tcp") or []
        return (
            info["State"]["Status"] == "running"
            and self.network in networks
            and bool(bound)
            and bound[0].get("HostIp", self.bind_address) in (self.bind_address, "")
            and (self.service_port is None or bound[0].get("HostPort") == str(self.service_port))
        )
