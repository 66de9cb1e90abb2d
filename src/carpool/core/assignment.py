"""One GPU of a `carpool.dev/assignment` annotation: the extender writes it at bind, the device
plugin hands exactly it to the container, the operator accounts it. One type for all three."""

from __future__ import annotations

from dataclasses import dataclass

# How long a bound pod counts as "in flight" (assigned, not yet handed over by the device
# plugin, not running) when nothing else ends it. The extender keeps a second pod with the same
# GPU count off a node while one is in flight, because Allocate carries no pod identity and the
# plugin tells such pods apart by count alone. A bound pod always leaves that state (the kubelet
# admits it, fails it, or it is deleted, e.g. when its node dies); the timeout is only a last
# resort, so it is long: a short one (60 s, until a 10,000-job load run showed it) let a second
# pod onto a node whose kubelet was slow to admit the first, and the plugin then handed the two
# each other's GPUs. The plugin uses the same value to rank a stale candidate last.
HAND_OVER_STALE_S = 600.0


@dataclass(frozen=True)
class AssignedGpu:
    """One GPU a container holds, as the extender recorded it at bind."""

    uuid: str
    index: int
    memory_mib: int
    cores_pct: int
    mig_instance: str = ""
    container: str = ""
