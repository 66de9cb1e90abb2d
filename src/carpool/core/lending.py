"""Lending within a GPU: the part of a running job's grant it has not used goes to
preemptible jobs until the owner needs it back.

Users ask for more GPU memory (and SMs) than their jobs use, and what they asked for is held
back from everyone else. Once an owner has run for `LendingPolicy.observed_s`, the part of
its grant above its measured peak plus headroom is *lent*: a preemptible MPS job with a
short checkpoint grace may be placed there as a *borrower*, with a grant of its own (MPS
limits are fixed when a client starts, so a borrower is sized and fenced like any client:
its own pinned-memory and thread limits, the watchdog behind them).

The owner keeps its whole grant: new owners never see lent capacity as free, and when an
owner's measured peak grows past what its lent part leaves it, the GPU is over-committed
and its newest borrowers are stopped (checkpoint, requeue) until it is not. The headroom
above the peak is the owner's room to grow while a borrower leaves, and a borrower's
checkpoint grace is at most `reclaim_within_s`, the bound on how long the owner waits.
When an owner ends, its borrowers stay: their grants then count as ordinary use of the
GPU (`placement._held`).

Whole GPUs (exclusive grants) lend only where `LendingPolicy.whole_gpus` says so. The owner
then keeps its own context outside MPS (unfenced: it holds the whole GPU) and a borrower runs
beside it as an MPS client with its own limits, so the GPU time-slices between the owner and
the borrowers while both compute: the owner gives up exclusive use of the SMs, never memory.
MIG instances never lend (their memory is a fixed partition).

Billing: a borrower is billed by its own grant like any job; the owner by its grant, which
it keeps. Pure: grants and measurements in, grants and stop lists out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from carpool.core.jobs import Job
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, Phase

MIB_PER_GIB = 1024


@dataclass(frozen=True)
class LendingPolicy:
    """How idle grants are lent (ProjectQuota-independent: a cluster setting)."""

    observed_s: float = 600.0  # an owner's peak is trusted after it ran this long
    headroom: float = 1.2  # the owner keeps its peak times this (memory in whole GiB)
    reclaim_within_s: float = 30.0  # borrowers must stop within this (their checkpoint grace)
    whole_gpus: bool = False  # exclusive (whole-GPU) owners lend too; borrowers share SM time

    def __post_init__(self) -> None:
        if self.observed_s < 0:
            raise ValueError("lending: observed time must not be negative")
        if self.headroom < 1:
            raise ValueError("lending: headroom must be at least 1 (the owner keeps its peak)")
        if self.reclaim_within_s <= 0:
            raise ValueError("lending: reclaim bound must be positive")


def may_borrow(request: GpuRequest, preemptible: bool, checkpoint_grace_s: float,
               policy: LendingPolicy) -> bool:
    """Whether a job may run in lent capacity: preemptible, an MPS client (fenced by its own
    limits) and able to leave within the reclaim bound."""
    return (preemptible and request.isolation is Isolation.MPS
            and checkpoint_grace_s <= policy.reclaim_within_s)


def yields_to_owner(victim: Job, victim_level: int, preemptor_preemptible: bool,
                    preemptor_level: int) -> bool:
    """Whether a borrower makes way for a waiting job that may not borrow (an owner) of at
    least its class, as for an owner's rise: lent capacity is lent until an owner's grant
    is needed, and a borrower whose lender ended holds that grant's room against the next
    owner. Preemption takes it only where its leaving lets the owner start (while its lender
    runs, the lent part stays the lender's and frees nothing); the owner ranks at least as
    high and never borrows, so the two cannot take turns."""
    return (not preemptor_preemptible and victim_level >= preemptor_level
            and any(g.borrowed for g in victim.grants))


def lendable(grant: GpuGrant, peak_memory_mib: int | None, peak_cores_pct: int | None,
             running_s: float, policy: LendingPolicy, calibrated_mib: int | None = None,
             calibrated_cores_pct: int | None = None) -> tuple[int, int]:
    """(memory MiB, cores %) of an owner's grant on one GPU it may lend: what lies above its
    measured peak times the headroom, once it ran `observed_s`; nothing for MIG grants,
    exclusive ones unless the policy lends whole GPUs, or where that was not measured (None).

    Before `observed_s`, an owner whose template's finished runs give a calibrated size
    (`right_sizing.recommended`, headroom included) lends what lies above the larger of that
    size and its own peak so far times the headroom: the runs before it stand for the peak
    it has not reached yet, and its measured rise past them reclaims as any rise does."""
    if ((grant.exclusive and not policy.whole_gpus)
            or grant.mig_instance or grant.lent or grant.borrowed):
        return 0, 0
    early = running_s < policy.observed_s
    memory = cores = 0
    if peak_memory_mib is not None and grant.memory_mib > 0:
        keep = _kept(math.ceil(peak_memory_mib * policy.headroom / MIB_PER_GIB) * MIB_PER_GIB,
                     calibrated_mib, early)
        if keep is not None:
            memory = max(0, grant.memory_mib - max(keep, MIB_PER_GIB))
    if peak_cores_pct is not None and grant.cores_pct > 0:
        keep = _kept(math.ceil(peak_cores_pct * policy.headroom), calibrated_cores_pct, early)
        if keep is not None:
            cores = max(0, grant.cores_pct - max(1, keep))
    return memory, cores


def _kept(measured: int, calibrated: int | None, early: bool) -> int | None:
    """What an owner keeps of one resource: its measured peak with headroom once observed;
    before, at least its calibrated size; None (lends nothing) before with no calibration."""
    if not early:
        return measured
    return None if calibrated is None else max(measured, calibrated)


def with_lendable(jobs: Iterable[Job], policy: LendingPolicy, now: float,
                  calibrated_mib: Mapping[tuple[str, str], int] | None = None) -> list[Job]:
    """The jobs, each running owner with the part of its grant it may lend set from its
    measured peak GPU memory (`Job.peak_memory_mib`, the device plugin's measure; SM use is
    not measured per process, so no cores are lent) and, before it ran `observed_s`, its
    (project, template)'s calibrated size from `calibrated_mib`."""
    calibrated_mib = calibrated_mib or {}
    out = []
    for job in jobs:
        started = job.started_at
        if (job.phase is Phase.RUNNING and job.grants and started is not None
                and not any(g.borrowed for g in job.grants)):
            # with a measured peak only: the extender, which trusts a peak at once, then
            # lends at least as much (it keeps no more than the peak with headroom)
            lent = [lendable(g, job.peak_memory_mib, None, now - started, policy,
                             calibrated_mib.get((job.project, job.template)))
                    for g in job.grants]
            memory = min(m for m, _ in lent)
            if memory != job.lendable_mib:
                job = replace(job, lendable_mib=memory, lendable_cores_pct=0)
        out.append(job)
    return out


def split(grants: Sequence[GpuGrant], lent_memory_mib: int, lent_cores_pct: int
          ) -> tuple[GpuGrant, ...]:
    """An owner's grants with the lent part of each split off as a `lent` grant (the same
    amounts per GPU); the grants themselves when nothing is lent. An exclusive owner's part
    stays exclusive: to new owners the GPU is still taken (`borrower_view` opens it)."""
    if lent_memory_mib <= 0 and lent_cores_pct <= 0:
        return tuple(grants)
    out: list[GpuGrant] = []
    for g in grants:
        memory = min(lent_memory_mib, g.memory_mib)
        cores = min(lent_cores_pct, g.cores_pct)
        if g.mig_instance or g.borrowed or (memory <= 0 and cores <= 0):
            out.append(g)
            continue
        out.append(replace(g, memory_mib=g.memory_mib - memory, cores_pct=g.cores_pct - cores))
        out.append(GpuGrant(g.gpu_uuid, memory, cores, lent=True))
    return tuple(out)


def borrower_view(state: NodeState) -> NodeState:
    """The node as a borrower sees it: lent parts free, other borrowers' grants held, a
    whole-GPU owner that lends no longer exclusive, and every GPU that no owner lends from
    closed. The placement rules then fit a borrower exactly as they fit anyone (`as_borrowed`
    marks what they grant).

    A GPU nobody lends is ordinary room, placed by the queue's order and reservations: a
    borrower put there would take a free GPU that a waiting owner was promised, and hold
    it until an owner preempts it (`yields_to_owner`)."""
    lending_gpus = {g.gpu_uuid for g in state.grants if g.lent}
    grants = tuple(replace(g, borrowed=False) if g.borrowed
                   else replace(g, exclusive=False) if g.exclusive and g.gpu_uuid in lending_gpus
                   else g
                   for g in state.grants if not g.lent)
    closed = tuple(GpuGrant(gpu.uuid, 0, 0, exclusive=True) for gpu in state.inventory.gpus
                   if gpu.uuid not in lending_gpus)
    return NodeState(state.inventory, grants + closed, state.cpu_used_milli,
                     state.memory_used_mib)


def as_borrowed(grants: Iterable[GpuGrant]) -> tuple[GpuGrant, ...]:
    return tuple(replace(g, borrowed=True) for g in grants)


def lends_anything(state: NodeState) -> bool:
    return any(g.lent for g in state.grants)


def reclaims(state: NodeState, borrowers: Mapping[str, tuple[float, tuple[GpuGrant, ...]]],
             leaving: Iterable[str] = ()) -> list[str]:
    """Borrowers to stop so that no GPU of `state` holds more than it has for its owners:
    newest first (least work lost), on the GPUs over-committed. `borrowers` maps each
    borrower on the node to (its start, its grants); `leaving` ones already go."""
    gone = set(leaving)
    over = _over_committed(state, gone, borrowers)
    if not over:
        return []
    stop: list[str] = []
    for key, (_, grants) in sorted(borrowers.items(), key=lambda kv: (-kv[1][0], kv[0])):
        if key in gone or not any(g.gpu_uuid in over for g in grants):
            continue
        stop.append(key)
        gone.add(key)
        over = _over_committed(state, gone, borrowers)
        if not over:
            break
    return stop


def _over_committed(state: NodeState, gone: set[str],
                    borrowers: Mapping[str, tuple[float, tuple[GpuGrant, ...]]]) -> set[str]:
    """GPUs (UUIDs) whose owners' grants and borrowers' beyond the lent parts exceed them,
    leaving out the grants of `gone` borrowers."""
    dropped = [g for key in gone if (entry := borrowers.get(key)) is not None
               for g in entry[1]]
    grants = list(state.grants)
    for g in dropped:
        for i, held in enumerate(grants):
            if held is g or (held == g and held.borrowed):
                del grants[i]
                break
    left = NodeState(state.inventory, tuple(grants), state.cpu_used_milli, state.memory_used_mib)
    return {f.gpu.uuid for f in left.free() if f.memory_mib < 0 or f.cores_pct < 0}
