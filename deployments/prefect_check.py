"""The Prefect side of ``gpuferry check``: the server the command talks to, its work pool and an online worker.

Orchestration, not a backend: the stack's blocks check their own systems (``Stack.check``), and the command adds
this group beside theirs (``prefect_group``), with the same deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blocks.checks import DEFAULT_TIMEOUT_S, CheckFailed, Probe, _one_line


def prefect_group(work_pool: str | None, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[Probe, Callable[[Probe], Any]]:
    """The Prefect checks as a group ``Stack.check`` runs beside the backends' (``more``)."""
    return Probe("prefect", "Prefect server", timeout=timeout), lambda probe: check_prefect(probe, work_pool)


def check_prefect(probe: Probe, work_pool: str | None) -> None:
    """The Prefect server the CLI talks to (PREFECT_API_URL), the work pool and an online worker on it."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        probe.add(
            "server",
            "warn",
            "PREFECT_API_URL is not set: runs use a temporary local server",
            "for deployments, a UI and workers: `prefect config set PREFECT_API_URL=http://HOST:4200/api`",
        )
        return

    def server() -> str:
        try:
            response = httpx.get(f"{api.rstrip('/')}/health", timeout=probe.left)
        except httpx.HTTPError as exc:
            raise CheckFailed(f"{api}: {_one_line(exc)}") from None
        if response.status_code != 200:
            raise CheckFailed(f"{api}/health answered HTTP {response.status_code}")
        version = httpx.get(f"{api.rstrip('/')}/admin/version", timeout=probe.left).json()
        return f"{api} (Prefect {version})"

    if not probe.step("server", server, "start the Prefect server, or point PREFECT_API_URL at the one you use"):
        return
    if work_pool is None:
        probe.skip("work pool", "no work pool given (--pool)")
        return
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:

        def pool() -> str:
            try:
                found = client.read_work_pool(work_pool)
            except ObjectNotFound:
                raise CheckFailed(
                    f"the server has no work pool {work_pool!r}",
                    f"create it: `prefect work-pool create {work_pool} --type process` (or pass --pool)",
                ) from None
            return f"{work_pool} ({found.type}{', paused' if found.is_paused else ''})"

        if not probe.step("work pool", pool):
            return

        def worker() -> Any:
            workers = client.read_workers_for_work_pool(work_pool)
            online = [w.name for w in workers if str(getattr(w.status, "value", w.status)).upper() == "ONLINE"]
            if not online:
                raise CheckFailed(
                    f"no worker of pool {work_pool!r} is online ({len(workers)} known, none polling)",
                    f"start one where the flows should run: `python -m deployments.worker --pool {work_pool}` "
                    f"(or `prefect worker start --pool {work_pool}`)",
                )
            return f"{len(online)} online: {', '.join(sorted(online)[:5])}"

        probe.step("online worker", worker)
