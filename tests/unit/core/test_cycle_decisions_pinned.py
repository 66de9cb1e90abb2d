"""The admission cycle's decisions on a seeded mixed cluster, pinned: a change made for speed
(indexes, caches, fewer passes over the holders) must leave every admission, preemption,
wait reason, position and estimated start exactly as they were."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from carpool.core.jobs import ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, CycleResult, admission_cycle, extender_placer
from carpool.core.resources import Gpu, GpuRequest, Isolation, JobClass, NodeInventory, Phase

T0 = 1_800_000_000.0
GIB = 1024
PROJECTS = ("vision", "speech", "search", "ads")
CLASSES = (JobClass.INTERACTIVE, JobClass.SHORT, JobClass.LONG, JobClass.BATCH)


def _nodes(count: int) -> dict[str, NodeState]:
    """H100 80 GiB and H200 141 GiB nodes of 8 GPUs; one in four offers whole GPUs only."""
    out = {}
    for i in range(count):
        name = f"n{i:03d}"
        model, memory = ("H100", 80) if i % 2 else ("H200", 141)
        sharing = (frozenset({Isolation.EXCLUSIVE}) if i % 4 == 3 else
                   frozenset({Isolation.MPS, Isolation.TIMESLICE, Isolation.EXCLUSIVE}))
        out[name] = NodeState(NodeInventory(name, tuple(
            Gpu(g, f"{name}-g{g}", model, memory * GIB) for g in range(8)), sharing=sharing))
    return out


def _job(i: int, rng: random.Random, submitted: float, projects: int,
         classes: tuple[JobClass, ...]) -> Job:
    cls = rng.choice(classes)
    if rng.random() < 0.45:
        request = GpuRequest(1, rng.choice([16, 24, 32, 48]) * GIB, rng.choice([25, 34, 50]),
                             sharing_limits=(("H100", 3),) if rng.random() < 0.1 else ())
    else:
        request = GpuRequest(rng.choice([1, 1, 2, 4]), 40 * GIB, 0, Isolation.EXCLUSIVE)
    if rng.random() < 0.3:
        request = replace(request, models=frozenset({rng.choice(["H100", "H200"])}))
    project = PROJECTS[i % projects]
    return Job(f"{project}/j{i}-run", project, cls, request, submitted,
               rng.uniform(300, 7200), preemptible=cls is JobClass.BATCH,
               checkpoint_grace_s=rng.choice([30.0, 120.0]))


def _scene() -> ClusterSnapshot:
    """A first cycle fills the cluster from 700 jobs of two projects, mostly batch (borrowing
    the other two's guarantees); ten minutes on, 300 more of all four arrive, mostly of
    higher classes (they reclaim and preempt), and 40 of the running ones have finished."""
    rng = random.Random(7)
    nodes = _nodes(48)
    quotas = {p: ProjectQuota(p, frozenset({p}), guaranteed_gpus=48 * 8 / 4, borrowing=True,
                              weight=1.0 + i)
              for i, p in enumerate(PROJECTS)}
    batch = (JobClass.BATCH,) * 3 + CLASSES
    jobs = [_job(i, rng, T0 + i, 2, batch) for i in range(700)]
    config = AdmissionConfig(node_placer=extender_placer())
    first = admission_cycle(ClusterSnapshot(T0 + 700, tuple(jobs), quotas, nodes), config)
    admitted = {a.job_key: a for a in first.admissions}
    later = T0 + 1300
    ended = set(rng.sample(sorted(admitted), 40))
    out = []
    for job in jobs:
        a = admitted.get(job.key)
        if a is None:
            out.append(job)
        elif job.key in ended:
            out.append(replace(job, phase=Phase.SUCCEEDED, attempts=1, runs=(
                RunRecord(1, T0 + 700, later - 5, a.gpu_fraction, a.node),)))
        else:
            out.append(replace(job, phase=Phase.RUNNING, attempts=1, node=a.node,
                               grants=a.grants, borrowed=a.borrowed, runs=(
                                   RunRecord(1, T0 + 705, None, a.gpu_fraction, a.node),)))
    out += [_job(i, rng, later - 300 + i, 4, CLASSES[:3]) for i in range(700, 1000)]
    return ClusterSnapshot(later, tuple(out), quotas, nodes)


def _digest(result: CycleResult) -> str:
    return hashlib.sha256(repr(result).encode()).hexdigest()[:16]


def test_the_cycle_on_a_mixed_cluster_decides_as_pinned() -> None:
    result = admission_cycle(_scene(), AdmissionConfig(node_placer=extender_placer()))
    assert (len(result.admissions), len(result.preemptions), len(result.waits)) == (103, 16, 617)
    assert {w.reason.value for w in result.waits} == {
        "BehindHigherRanked", "Quota", "Capacity", "Preempting"}
    # every field of every decision, messages and estimated starts included
    assert _digest(result) == "aee7383d1deb9743"
