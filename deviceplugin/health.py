"""GPU health: driver events mark a GPU unhealthy; it becomes healthy again once it has been
quiet for a while and a fresh probe passes (the NVIDIA plugin keeps GPUs unhealthy until it is
restarted, a known complaint)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from carpool.deviceplugin.backends.base import HealthEvent, HealthEventKind

# Xids caused by the application, not the GPU (NVIDIA's Xid catalogue): an illegal address in a
# user kernel (13, 31, 43, 45 preemptive cleanup, 68 video decoder, 109 context switch timeout)
# must not take the GPU away from everybody else.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass
class HealthTracker:
    recover_after_s: float = 60.0
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    _bad_since: dict[str, float] = field(default_factory=dict)  # uuid -> time of the last event
    _reasons: dict[str, str] = field(default_factory=dict)

    @property
    def unhealthy(self) -> frozenset[str]:
        return frozenset(self._bad_since)

    def reason(self, gpu_uuid: str) -> str:
        return self._reasons.get(gpu_uuid, "")

    def counts(self, event: HealthEvent) -> bool:
        """Whether an event means the GPU itself is in trouble."""
        return event.kind is HealthEventKind.ECC or event.code not in self.ignored_xids

    def record(self, events: Iterable[HealthEvent], now: float) -> bool:
        """Take driver events; True when some GPU turned unhealthy."""
        changed = False
        for event in events:
            if not self.counts(event):
                continue
            changed |= event.gpu_uuid not in self._bad_since
            self._bad_since[event.gpu_uuid] = now
            self._reasons[event.gpu_uuid] = (
                f"{event.kind.value} {event.code}" + (f": {event.message}" if event.message else "")
            )
        return changed

    def mark(self, gpu_uuid: str, reason: str, now: float) -> bool:
        """Mark a GPU unhealthy for a reason found by polling (e.g. it stopped answering)."""
        changed = gpu_uuid not in self._bad_since
        self._bad_since[gpu_uuid] = now
        self._reasons[gpu_uuid] = reason
        return changed

    def recheck(self, probe: Callable[[str], bool], now: float) -> bool:
        """Restore GPUs quiet for `recover_after_s` whose probe passes; True if any recovered."""
        recovered = [
            uuid for uuid, since in self._bad_since.items()
            if now - since >= self.recover_after_s and probe(uuid)
        ]
        for uuid in recovered:
            del self._bad_since[uuid]
            self._reasons.pop(uuid, None)
        return bool(recovered)
