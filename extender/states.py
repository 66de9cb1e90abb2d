"""Node states as the extender's cache hands them out (one per node until it changes).

`CachedState` is the core's `DerivedState` (free GPUs, scoring profile and GPUs by slot kept
per state) plus what only the extender asks: whether a request would fit the node were it
empty (filter's "resolvable").
"""

from __future__ import annotations

from functools import cached_property

from carpool.core.derived import DerivedState
from carpool.core.placement import NodeState, node_rejection
from carpool.core.resources import GpuRequest


class CachedState(DerivedState):
    """A `DerivedState` that also keeps its empty-node fits, per request."""

    @cached_property
    def _empty_fits(self) -> dict[GpuRequest, bool]:
        return {}

    def fits_empty(self, request: GpuRequest) -> bool:
        """Whether `request` would fit this node with nothing on it."""
        fits = self._empty_fits.get(request)
        if fits is None:
            fits = self._empty_fits[request] = node_rejection(NodeState(self.inventory),
                                                              request) is None
        return fits
