"""Which GPUs of one host a container gets: the bookkeeping of a host without a scheduler (pure: no I/O).

A host's inventory is what its ``nvidia-smi`` reports (index and UUID of each GPU, through the stack's
provider). A request asks for a number of GPUs, or for particular ones by index or by UUID, and says
whether it may share. The claims are what the containers already on the host hold (their labels).

``choose(inventory, request, claims)`` returns the GPUs for the request or raises, before anything starts:

* ``ConfigurationError`` when the host cannot ever satisfy it — more GPUs than it has, an index or UUID
  it does not have — naming the GPUs the host has;
* ``GpusBusy`` when the GPUs it needs are held now, naming who holds which and which are free.

Two containers never get the same GPU unless both asked to share it; a request for a count gets the
free GPUs with the lowest indices (a sharing request: the least shared ones first).

A GPU is named in the claims by its ``key``: its UUID (stable when indices move), else its index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blocks.errors import ConfigurationError
from blocks.records import GpuInfo


class GpusBusy(ConfigurationError):
    """The host has the GPUs the request needs, but other containers hold them now."""


@dataclass(frozen=True)
class HostGpu:
    """One GPU of the host."""

    index: int
    uuid: str | None = None
    name: str = ""

    @property
    def key(self) -> str:
        """How claims name this GPU: its UUID, else its index."""
        return self.uuid or str(self.index)

    def describe(self) -> str:
        detail = ", ".join(part for part in (self.uuid, self.name) if part)
        return f"{self.index} ({detail})" if detail else str(self.index)


@dataclass(frozen=True)
class GpuRequest:
    """What one container asks for: ``count`` GPUs, or the ``devices`` named (indices or UUIDs)."""

    count: int = 0
    devices: tuple[str, ...] = ()
    share: bool = False

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigurationError(f"a GPU count cannot be negative ({self.count})")
        if self.devices and self.count not in (0, len(self.devices)):
            raise ConfigurationError(
                f"asked for {self.count} GPU(s) but named {len(self.devices)}: {list(self.devices)}"
            )

    @property
    def wanted(self) -> int:
        return len(self.devices) or self.count

    @property
    def by_uuid(self) -> bool:
        """The devices are named by UUID (not by index)."""
        return bool(self.devices) and not all(d.isdigit() for d in self.devices)


@dataclass(frozen=True)
class Claim:
    """GPUs a container on the host holds."""

    owner: str
    gpus: tuple[str, ...]
    shared: bool = False


def inventory_of(gpus: Iterable[GpuInfo]) -> list[HostGpu]:
    """The provider's GPUs (``Node.gpus``) as an inventory, checked: each index and UUID once."""
    inventory = sorted((HostGpu(index=g.index, uuid=g.uuid, name=g.name) for g in gpus), key=lambda g: g.index)
    indices = [str(g.index) for g in inventory]
    uuids = [g.uuid for g in inventory if g.uuid]
    for what, values in (("index", indices), ("UUID", uuids)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ConfigurationError(f"the host's GPU inventory lists the {what} {', '.join(repeated)} twice")
    return inventory


def describe_inventory(inventory: Sequence[HostGpu]) -> str:
    return "; ".join(g.describe() for g in inventory) if inventory else "no GPU"


def resolve(inventory: Sequence[HostGpu], devices: Sequence[str], *, host: str = "the host") -> list[HostGpu]:
    """The inventory's GPUs that ``devices`` name (an index, or a UUID: case does not matter)."""
    by_index = {str(g.index): g for g in inventory}
    by_uuid = {g.uuid.lower(): g for g in inventory if g.uuid}
    found, unknown = [], []
    for device in devices:
        gpu = by_index.get(device) if device.isdigit() else by_uuid.get(device.lower())
        if gpu is None:
            unknown.append(device)
        else:
            found.append(gpu)
    if unknown:
        raise ConfigurationError(
            f"gpu_devices names {', '.join(repr(u) for u in unknown)}, which {host} does not have; it has "
            f"{len(inventory)} GPU(s): {describe_inventory(inventory)}. Name GPUs by these indices or UUIDs"
        )
    if len({g.index for g in found}) != len(found):
        raise ConfigurationError(f"gpu_devices {list(devices)} names one GPU of {host} twice (by index and by UUID)")
    return found


def check_fits(inventory: Sequence[HostGpu], request: GpuRequest, *, host: str = "the host") -> list[HostGpu] | None:
    """Whether the host could ever satisfy ``request`` (no claims looked at): the named GPUs, or None for a count.
    ``ConfigurationError`` naming what the host has when it cannot."""
    if request.devices:
        return resolve(inventory, request.devices, host=host)
    if request.count > len(inventory):
        raise ConfigurationError(
            f"asks for {request.count} GPU(s) but {host} has {len(inventory)}: {describe_inventory(inventory)}. "
            "Ask for fewer (resources.gpus_per_node / serving.gpus), or use a host with more"
        )
    return None


def choose(
    inventory: Sequence[HostGpu],
    request: GpuRequest,
    claims: Iterable[Claim],
    *,
    yielding: Iterable[Claim] = (),
    host: str = "the host",
) -> list[HostGpu]:
    """The GPUs for ``request`` given what ``claims`` hold; see the module's docstring. ``yielding``: claims
    the request may take over (a service's running version, which its next version replaces): their GPUs are
    given only when too few others are free."""
    if request.wanted == 0:
        return []
    named = check_fits(inventory, request, host=host)
    yielded = {key for claim in yielding for key in claim.gpus}
    holders: dict[str, list[Claim]] = {}
    for claim in claims:
        for key in claim.gpus:
            holders.setdefault(key, []).append(claim)

    def usable(gpu: HostGpu) -> bool:
        held = holders.get(gpu.key, [])
        return not held or (request.share and all(c.shared for c in held))

    if named is not None:
        taken = [g for g in named if not usable(g)]
        if taken:
            raise GpusBusy(
                _busy_message(f"gpu_devices {list(request.devices)}", taken, inventory, holders, host, request.share)
            )
        return named
    free = [g for g in inventory if usable(g)]
    if len(free) < request.count:
        held = [g for g in inventory if not usable(g)]
        raise GpusBusy(
            _busy_message(f"{request.count} GPU(s)", held, inventory, holders, host, request.share, free=free)
        )
    # Least shared first (0 for an exclusive request: every free GPU is unclaimed), not a yielding one, by index.
    free.sort(key=lambda g: (len(holders.get(g.key, [])), g.key in yielded, g.index))
    return sorted(free[: request.count], key=lambda g: g.index)


def _busy_message(
    asked: str,
    taken: Sequence[HostGpu],
    inventory: Sequence[HostGpu],
    holders: dict[str, list[Claim]],
    host: str,
    share: bool,
    free: Sequence[HostGpu] | None = None,
) -> str:
    held = "; ".join(
        f"GPU {g.describe()} by {', '.join(c.owner + (' (sharing)' if c.shared else '') for c in holders[g.key])}"
        for g in taken
    )
    if free is None:
        free = [g for g in inventory if g.key not in holders]
    hint = (
        " (they do not share: sharing needs share_gpus on both)"
        if share
        else ", or let the containers share GPUs (share_gpus on both)"
    )
    return (
        f"{host} cannot give {asked} now: {held}. Free: {', '.join(str(g.index) for g in free) or 'none'} of "
        f"{len(inventory)}. Wait for those to finish, ask for free GPUs{hint}"
    )


def claim_label(gpus: Sequence[HostGpu]) -> str:
    """The GPUs as a container label's value (their keys, comma-separated)."""
    return ",".join(g.key for g in gpus)


def parse_claim_label(value: str | None) -> tuple[str, ...]:
    return tuple(part for part in (value or "").split(",") if part)
