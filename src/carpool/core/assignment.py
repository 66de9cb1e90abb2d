"""One GPU of a `carpool.dev/assignment` annotation: the extender writes it at bind, the device
plugin hands exactly it to the container, the operator accounts it. One type for all three."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AssignedGpu:
    """One GPU a container holds, as the extender recorded it at bind."""

    uuid: str
    index: int
    memory_mib: int
    cores_pct: int
    mig_instance: str = ""
    container: str = ""
