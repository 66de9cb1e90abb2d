"""Builders of the core's snapshot objects for tests: a node of identical GPUs, a job, a
project quota, with the defaults most tests want (a test narrows them with
`functools.partial`), and the simple policies tests use as references."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from carpool.core.accounting import job_gpu_hours
from carpool.core.derived import DerivedState
from carpool.core.gpu_choice import NoFit, choose_gpus, grants_for
from carpool.core.jobs import Job, ProjectQuota
from carpool.core.placement import NodeState
from carpool.core.resources import (
    Gpu,
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
)
from carpool.core.scoring import RequestScorer, Scorer

GIB = 1024  # MiB
HOUR = 3600.0  # seconds
_DEFAULT_SCORER = Scorer()  # the scorer `packing_placer` chooses GPUs with (empty workload)


def gpu_node(name: str = "n1", gpus: int = 2, model: str = "H100",
             memory_gib: int = 80) -> NodeState:
    """A node of `gpus` identical GPUs, `<name>-g<i>`, nothing granted."""
    return NodeState(NodeInventory(name, tuple(Gpu(i, f"{name}-g{i}", model, memory_gib * GIB)
                                               for i in range(gpus))))


def gpu_job(key: str, project: str = "a", cls: JobClass = JobClass.BATCH, count: int = 1, *,
            memory_gib: int = 10, exclusive: bool = True, models: frozenset[str] = frozenset(),
            submitted: float = 0.0, estimate: float = HOUR, **fields: Any) -> Job:
    """A queued job asking `count` GPUs of `memory_gib` each (exclusive, else MPS); any other
    `Job` field by name."""
    request = GpuRequest(count, memory_gib * GIB, models=models,
                         isolation=Isolation.EXCLUSIVE if exclusive else Isolation.MPS)
    return Job(key, project, cls, request, submitted, estimate, **fields)


def project_quota(name: str = "a", **fields: Any) -> ProjectQuota:
    """The project `name` billing its own namespace `name`; any other field by name."""
    return ProjectQuota(name, frozenset({name}), **fields)


def packing_placer(node: NodeState, request: GpuRequest
                   ) -> tuple[float, tuple[GpuGrant, ...]] | None:
    """A node placer (`carpool.core.timeline.NodePlacer`) ranking independently of the extender's
    scoring: the GPUs are the extender's choice (`gpu_choice.choose_gpus` under a default
    scorer), the score prefers the node that ends up fullest.

    score = (GPU memory granted on the node after placement) / (node's total GPU memory), in
    [0, 1]; a node without GPUs scores 0.
    """
    state = DerivedState.of(node)
    choice = choose_gpus(state, RequestScorer(request, _DEFAULT_SCORER))
    if isinstance(choice, NoFit):
        return None
    grants = grants_for(state, request, choice[1])
    return packing_score(node, grants), grants



def packing_score(node: NodeState, grants: tuple[GpuGrant, ...]) -> float:
    """`packing_placer`'s score for `grants` added to `node`."""
    total = sum(g.memory_total_mib for g in node.inventory.gpus)
    if total <= 0:
        return 0.0
    used = sum(g.memory_mib for g in node.grants) + sum(g.memory_mib for g in grants)
    return min(1.0, used / total)


def project_gpu_hours(jobs: Iterable[Job], now: float) -> dict[str, float]:
    """All-time GPU-hours per project, summed over its jobs (the reference accounting is
    checked against)."""
    totals: dict[str, float] = {}
    for job in jobs:
        totals[job.project] = totals.get(job.project, 0.0) + job_gpu_hours(job, now)
    return totals
