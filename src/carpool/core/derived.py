"""A node state that keeps what placement and scoring derive from it.

The core's functions recompute what they need from a plain `NodeState` on every call and
keep nothing. A caller that asks many questions of one unchanging state opts into
`DerivedState`: its free GPUs, scoring profile, GPUs per scoring slot and the GPUs where the
slot view is not the fit rules (`scoring.doubtful_gpus`) are computed on first
use and kept with the state, so they go when the state goes. The extender's watch cache hands
these out (one per node until the node changes), and the admission cycle's timeline builds
its what-if states from them; property tests check each value equals the pure function's.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Self

from carpool.core.placement import GpuFree, NodeState, free_after
from carpool.core.resources import GpuGrant, Isolation
from carpool.core.scoring import GpusBySlot, NodeProfile, doubtful_gpus, gpus_by_slot, profile_of


class DerivedState(NodeState):
    """A `NodeState` whose derived values are kept (the state never changes: a change on the
    node makes a new one; `with_grants` makes another of the same kind)."""

    @classmethod
    def of(cls, state: NodeState) -> Self:
        """`state` itself when it already is one, else a copy that keeps what it derives."""
        if isinstance(state, cls):
            return state
        return cls(state.inventory, state.grants, state.cpu_used_milli, state.memory_used_mib)

    def with_grants(self, grants: Iterable[GpuGrant]) -> Self:
        """This state with `grants` added; where this state has worked out its free GPUs,
        the new state's are worked out from them (`placement.free_after`: only the GPUs the
        grants are on), and kept."""
        state = super().with_grants(grants)
        frees = self.__dict__.get("frees")
        if frees is not None:  # filled in as `frees` would keep it
            state.__dict__["frees"] = tuple(free_after(frees, state.grants, len(self.grants)))
        return state  # type: ignore[return-value]

    @cached_property
    def frees(self) -> tuple[GpuFree, ...]:
        return tuple(super().free())

    def free(self) -> list[GpuFree]:
        return list(self.frees)

    @cached_property
    def frees_by_index(self) -> dict[int, GpuFree]:
        return {f.gpu.index: f for f in self.frees}

    @cached_property
    def profile(self) -> NodeProfile:
        return profile_of(self)

    @cached_property
    def shared_gpus(self) -> GpusBySlot:
        return gpus_by_slot(self, exclusive=False)

    @cached_property
    def exclusive_gpus(self) -> GpusBySlot:
        return gpus_by_slot(self, exclusive=True)

    def gpus_by_slot(self, exclusive: bool) -> GpusBySlot:
        return self.exclusive_gpus if exclusive else self.shared_gpus

    def doubtful_gpus(self, isolation: Isolation) -> frozenset[int]:
        # (by identity, not a dict keyed by the enum: this is asked for every node a new
        # demand shape meets, and an Enum hashes in Python)
        if isolation is Isolation.MPS:
            return self._doubtful_mps
        if isolation is Isolation.MIG:
            return self._doubtful_mig
        return self._doubtful_other

    @cached_property
    def _doubtful_mps(self) -> frozenset[int]:
        return doubtful_gpus(self, Isolation.MPS)

    @cached_property
    def _doubtful_mig(self) -> frozenset[int]:
        return doubtful_gpus(self, Isolation.MIG)

    @cached_property
    def _doubtful_other(self) -> frozenset[int]:  # time-slicing and exclusive use alike
        return doubtful_gpus(self, Isolation.TIMESLICE)
