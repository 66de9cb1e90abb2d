"""Which GPUs of a node a request gets: one rule for the extender's filter, prioritize and
bind and for the operator's what-if timeline, so the GPUs the operator reserves are the ones
the extender pins.

The rule: the scorer's plan (`Scorer.plan`: GPUs taken one at a time by the same score as
nodes) among the GPUs the filter's rules accept (`placement.gpu_rejection`), each planned
slot given to the coolest, then lowest-numbered, accepted GPU behind it. A request with
sharing limits (`core.interference`) plans only among the accepted GPUs whose company is most
like its own copies (`placement.sharing_cost`), so light services gather with light ones and
heavy jobs with heavy ones. The scorer sees a GPU as a slot (model, idle compute, free
memory); the filter also knows MIG instances, MPS ceilings and over-booked GPUs, so the two
can disagree on a GPU, and the filter's rules win.
Which MIG instance of a chosen GPU is used is `placement.grant_for`'s (the smallest that fits).
"""

from __future__ import annotations

from dataclasses import replace

from carpool.core.derived import DerivedState
from carpool.core.placement import (
    NodeState,
    gpu_rejection,
    gpu_verdicts,
    grant_for,
    node_rejection,
    sharing_cost,
)
from carpool.core.resources import GpuGrant, GpuRequest
from carpool.core.scoring import GpusBySlot, PlanNotOnNode, RequestScorer, gpus_for, slot_fits

# The node's score in [0, 1] (0 where the scorer's own view cannot hold the request) and the
# GPUs the request gets (indices, one per GPU asked for); a plain tuple, as the scorer
# answers it (this is made for every node a new demand shape meets).
GpuChoice = tuple[float, tuple[int, ...]]


class NoFit:
    """The node cannot take the request. Why (`placement.node_rejection`'s reason) is worked
    out when asked: the operator never asks, the extender's filter only when it reports why
    nodes failed."""

    __slots__ = ("_reason", "_request", "_state")

    def __init__(self, state: NodeState, request: GpuRequest) -> None:
        self._state = state
        self._request = request
        self._reason: str | None = None

    @property
    def reason(self) -> str:
        if self._reason is None:
            self._reason = node_rejection(self._state, self._request) or "no GPUs fit"
        return self._reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoFit) and self.reason == other.reason

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NoFit({self.reason!r})"


def choose_gpus(state: DerivedState, scorer: RequestScorer) -> GpuChoice | NoFit:
    """The GPUs `scorer`'s request gets on the node, and the node's score; or why the node
    cannot take it.

    Plain definition (`choose_gpus_plainly`): the plan among the accepted GPUs that the
    scorer's view also fits, or, where those are too few, among every accepted GPU; with the
    pod's CPU and memory left out of the plan where the node's free CPU and memory cannot hold
    them (kube-scheduler enforces those: the node stays usable, ranked last with score 0, as
    it is in the too-few case). Fast path: the scorer's memoised plan over every GPU it sees,
    kept when the GPUs it maps to are all accepted (checked only on the state's
    `doubtful_gpus`: elsewhere a fitting slot is an accepted GPU) and the request has no
    sharing limits (those compare every accepted GPU's sharing cost). Then the plain plan is the
    same one: each greedy step picks the best candidate slot, and the fast path's pick is
    among the plain path's candidates, a subset of its own (tests/unit/core/test_gpu_choice.py).
    """
    request = scorer.request
    inventory = state.inventory
    if inventory.ready and request.isolation in inventory.sharing:
        try:
            scored = scorer.score_with(state, state.profile,
                                       state.gpus_by_slot(scorer.exclusive))
        except PlanNotOnNode:
            scored = None
        if scored is not None:
            doubtful = state.doubtful_gpus(request.isolation)
            if not request.sharing_limits and (not doubtful or doubtful.isdisjoint(scored[1])):
                return scored
            frees = state.frees_by_index
            if not request.sharing_limits and all(
                    gpu_rejection(frees[i], request) is None for i in scored[1]):
                return scored
    return choose_gpus_plainly(state, scorer)


def choose_gpus_plainly(state: DerivedState, scorer: RequestScorer) -> GpuChoice | NoFit:
    """`choose_gpus` by its definition, without the fast path."""
    request = scorer.request
    verdicts = gpu_verdicts(state, request)
    if isinstance(verdicts, str) or verdicts.count(None) < request.count:
        return NoFit(state, request)
    accepted = {f.gpu.index for f, v in zip(state.frees, verdicts, strict=True) if v is None}
    if request.sharing_limits:
        accepted = least_sharing_cost(state, request, accepted)
    demand = scorer.demand
    # every accepted GPU is usable, not held exclusively and (for an exclusive request)
    # untouched, so it has a slot in the scorer's view
    among: GpusBySlot = {}
    for slot, gpus in state.gpus_by_slot(scorer.exclusive).items():
        kept = tuple(g for g in gpus if g.gpu_index in accepted)
        if kept:
            among[slot] = kept
    fitting = {slot: gpus for slot, gpus in among.items() if slot_fits(slot, demand)}
    profile = state.profile
    host_fits = (profile.cpu_free_milli >= demand.cpu_milli
                 and profile.memory_free_mib >= demand.memory_mib)
    in_view = sum(len(gpus) for gpus in fitting.values()) >= request.count
    if in_view:
        among = fitting
    if not host_fits:
        demand = replace(demand, cpu_milli=0, memory_mib=0)
    plan = scorer.scorer.plan_among(profile, demand,
                                    {slot: len(gpus) for slot, gpus in among.items()})
    if plan is None:  # accepted GPUs all have a slot; unreachable
        raise AssertionError(f"no plan for {request} among {len(accepted)} accepted GPUs")
    indices, temperature = gpus_for(state, among, plan.slots)
    score = scorer.combine(state, plan.score, temperature) if in_view and host_fits else 0.0
    return score, indices


def least_sharing_cost(state: DerivedState, request: GpuRequest, accepted: set[int]
                       ) -> set[int]:
    """The accepted GPUs a request with sharing limits chooses among: the `request.count`
    whose company is most like its own copies (`placement.sharing_cost`; an untouched GPU
    counts as alike, and a shared GPU as alike goes first), with every GPU that ranks as
    the last of them."""
    frees = state.frees_by_index
    rank = {i: (sharing_cost(frees[i], request), not frees[i].sharers) for i in accepted}
    bar = sorted(rank.values())[request.count - 1]
    return {i for i, key in rank.items() if key <= bar}


def grants_for(state: DerivedState, request: GpuRequest, indices: tuple[int, ...]
               ) -> tuple[GpuGrant, ...]:
    """The grants of `request` on the GPUs `choose_gpus` chose (`placement.grant_for` each)."""
    frees = state.frees_by_index
    return tuple(grant_for(frees[i], request) for i in indices)
