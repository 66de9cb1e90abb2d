"""Property tests: invariants of the admission core over random clusters and event sequences.

A small simulator plays the operator: it runs `admission_cycle`, carries out its decisions
(pods start at once, preempted pods leave after their grace period, jobs end after a random
actual run time, never past their limit), advances the clock and repeats. At every step and
at every instant that matters it checks:

- no GPU holds more memory or cores than it has, and exclusive GPUs are not shared;
- no project exceeds its concurrent guarantee (or its cap with borrowing) at any instant;
- no Hold project uses more GPU-hours in a period than its budget, at any instant;
- no job is admitted twice, admitted while holding GPUs, or both admitted and waiting;
- preemption never picks a non-preemptible, interactive, too-young or terminating job;
- GPU-hours derived from run records equal those the simulator saw happen, and per-project
  totals equal the sum over jobs;
- the same snapshot gives the same result whatever the order of its jobs and nodes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.core.accounting import (
    grants_fraction,
    job_gpu_hours,
    project_usage,
)
from carpool.core.jobs import BudgetPolicy, ClusterSnapshot, Job, ProjectQuota, RunRecord
from carpool.core.placement import NodeState
from carpool.core.queueing import AdmissionConfig, CycleResult, admission_cycle
from carpool.core.resources import Gpu, GpuRequest, Isolation, JobClass, NodeInventory, Phase
from carpool_testbed.builders import GIB, HOUR, packing_placer, project_gpu_hours

EPS = 1e-6
EPOCH = 1_780_000_000.0  # times as the operator passes them: float steps are ~2.4e-7 s


@dataclass
class World:
    nodes: dict[str, NodeState]
    quotas: dict[str, ProjectQuota]
    jobs: list[Job]
    actual_s: dict[str, float]  # how long each job really runs, if not stopped
    steps: list[float]
    config: AdmissionConfig
    base: float = 0.0  # the clock at the start: 0, or an epoch time as the operator passes


@st.composite
def worlds(draw: st.DrawFn, contended: bool = False) -> World:
    """Random clusters, quotas and jobs; `contended` ones are a single small node where
    low-class preemptible jobs come first and higher classes arrive later (preemption)."""
    base = draw(st.sampled_from([0.0, EPOCH]))
    nodes = {}
    for i in range(1 if contended else draw(st.integers(1, 3))):
        memory = draw(st.sampled_from([40, 80])) * GIB
        gpus = tuple(Gpu(k, f"n{i}-g{k}", draw(st.sampled_from(["H100", "A100"])), memory)
                     for k in range(draw(st.integers(1, 4))))
        nodes[f"n{i}"] = NodeState(NodeInventory(f"n{i}", gpus))
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    quotas = {}
    for name in names:
        memory_gib = draw(st.sampled_from([None, None, None, 80, 200]))
        quotas[name] = ProjectQuota(
            name, frozenset({name}),
            guaranteed_gpus=draw(st.sampled_from([None, None, None, 0.5, 1.0, 2.0, 4.0])),
            guaranteed_memory_mib=None if memory_gib is None else memory_gib * GIB,
            borrowing=draw(st.booleans()),
            borrow_limit_gpus=draw(st.one_of(st.none(), st.sampled_from([0.5, 1.0, 3.0]))),
            budget_gpu_hours=None if contended else draw(
                st.sampled_from([None, None, None, 0.5, 2.0, 6.0])),
            period_s=draw(st.sampled_from([2 * HOUR, 5 * HOUR])),
            period_anchor=draw(st.sampled_from([0.0, 1800.0])),
            on_budget_exhausted=draw(st.sampled_from(list(BudgetPolicy))),
            weight=draw(st.sampled_from([0.5, 1.0, 3.0])))
    jobs, actual = [], {}
    for i in range(draw(st.integers(1, 12))):
        project = draw(st.sampled_from(names))
        namespace = project if draw(st.integers(0, 14)) else "stray"
        isolation = draw(st.sampled_from([Isolation.EXCLUSIVE, Isolation.MPS]))
        request = GpuRequest(
            draw(st.integers(1, 2)), draw(st.sampled_from([5, 20, 40])) * GIB,
            cores_pct=draw(st.sampled_from([0, 30])), isolation=isolation,
            models=draw(st.sampled_from([frozenset(), frozenset(), frozenset({"A100"})])))
        estimate = draw(st.sampled_from([600.0, 1800.0, 3600.0, 7200.0]))
        key = f"{namespace}/j{i}"
        submitted = draw(st.sampled_from([0.0, 300.0, 2000.0, 5000.0]))
        job_class = draw(st.sampled_from(list(JobClass)))
        if contended:  # batch first, interactive last
            job_class = JobClass(max(0, 3 - int(submitted // 1500)))
        jobs.append(Job(
            key, project, job_class, request,
            submitted_at=base + submitted,
            estimated_duration_s=estimate,
            max_duration_s=estimate * draw(st.sampled_from([0, 1, 2])),
            preemptible=draw(st.booleans()) or (contended and draw(st.booleans())),
            checkpoint_grace_s=draw(st.sampled_from([0.0, 30.0, 120.0])),
            min_runtime_s=draw(st.sampled_from([0.0, 600.0]))))
        actual[key] = estimate * draw(st.sampled_from([0.3, 1.0, 1.5]))
    steps = draw(st.lists(st.sampled_from([60.0, 600.0, 1800.0]), min_size=3, max_size=8))
    config = AdmissionConfig(node_placer=packing_placer,
                             aging_step_s=draw(st.sampled_from([0.0, 3600.0])),
                             reservation_depth=draw(st.sampled_from([1, 64])))
    return World(nodes, quotas, jobs, actual, steps, config, base)


class Simulator:
    """Plays the operator around the pure core."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.jobs = {j.key: j for j in world.jobs}
        self.leave_at: dict[str, float] = {}
        self.seen_gpu_hours: dict[str, float] = dict.fromkeys(self.jobs, 0.0)
        self.now = world.base

    def snapshot(self) -> ClusterSnapshot:
        visible = tuple(j for j in self.jobs.values() if j.submitted_at <= self.now)
        return ClusterSnapshot(self.now, visible, self.world.quotas, self.world.nodes)

    # ------------------------------------------------------------ carrying out decisions

    def apply(self, result: CycleResult) -> None:
        for adm in result.admissions:
            job = self.jobs[adm.job_key]
            self.jobs[job.key] = replace(
                job, phase=Phase.RUNNING, node=adm.node, grants=adm.grants,
                borrowed=adm.borrowed, attempts=adm.attempt,
                runs=(*job.runs, RunRecord(adm.attempt, self.now, None, adm.gpu_fraction)))
        for pre in result.preemptions:
            victim = self.jobs[pre.victim_key]
            self.jobs[victim.key] = replace(victim, phase=Phase.PREEMPTED)
            self.leave_at[victim.key] = self.now + pre.grace_s
        for exp in result.expiries:
            self.leave_at.setdefault(exp.job_key, self.now + exp.grace_s)

    def _close(self, key: str, at: float, phase: Phase) -> None:
        job = self.jobs[key]
        run = job.current_run
        assert run is not None
        closed = replace(run, end=at)
        self.seen_gpu_hours[key] += run.fraction * (at - run.start) / HOUR
        runs = tuple(closed if r.attempt == run.attempt else r for r in job.runs)
        self.jobs[key] = replace(job, phase=phase, node="", grants=(), borrowed=False, runs=runs)
        self.leave_at.pop(key, None)

    def _next_event(self) -> tuple[float, str, Phase] | None:
        events = []
        for job in self.jobs.values():
            run = job.current_run
            if run is None:
                continue
            natural = run.start + min(self.world.actual_s[job.key], job.limit_s)
            hit_limit = self.world.actual_s[job.key] > job.limit_s
            events.append((natural, job.key, Phase.FAILED if hit_limit else Phase.SUCCEEDED))
            if job.key in self.leave_at and self.leave_at[job.key] < natural:
                phase = Phase.PREEMPTED if job.phase is Phase.PREEMPTED else Phase.FAILED
                events.append((self.leave_at[job.key], job.key, phase))
        return min(events) if events else None

    def advance(self, dt: float, check: object) -> None:
        """Play events up to now + dt, checking the budget just before every refill."""
        target = self.now + dt
        boundaries = sorted({b for q in self.world.quotas.values()
                             for b in _boundaries(q, self.now, target)})
        while True:
            event = self._next_event()
            boundary = boundaries[0] if boundaries else math.inf
            if event is not None and event[0] <= target and event[0] <= boundary:
                self._close(event[1], event[0], event[2])
                continue
            if boundary <= target:
                assert callable(check)
                check(boundary - EPS)
                boundaries.pop(0)
                continue
            break
        self.now = target


def _boundaries(quota: ProjectQuota, start: float, end: float) -> list[float]:
    out, b = [], quota.period_end(start)
    while b <= end:
        out.append(b)
        b += quota.period_s
    return out


# ---------------------------------------------------------------- invariants


def check_cycle(snapshot: ClusterSnapshot, result: CycleResult) -> None:
    jobs = {j.key: j for j in snapshot.jobs}
    admitted = [a.job_key for a in result.admissions]
    assert len(admitted) == len(set(admitted)), "a job admitted twice in one cycle"
    for key in admitted:
        job = jobs[key]
        assert job.waiting, f"{key} admitted while not waiting ({job.phase})"
        assert job.namespace in snapshot.quotas[job.project].namespaces
    waiting = {k for k, j in jobs.items() if j.waiting}
    decided = admitted + [w.job_key for w in result.waits]
    assert sorted(decided) == sorted(waiting), "every waiting job gets exactly one decision"
    queued = [w for w in result.waits if not w.reason.refused]
    assert [w.position for w in queued] == list(range(1, len(queued) + 1))
    for wait in result.waits:
        if wait.reason.refused:
            assert wait.estimated_start is None and wait.position == 0
        elif wait.estimated_start is not None:
            assert wait.estimated_start >= snapshot.now, f"{wait.job_key} estimated in the past"
    victims = [p.victim_key for p in result.preemptions]
    assert len(victims) == len(set(victims)) and not set(victims) & set(admitted)
    for pre in result.preemptions:
        victim = jobs[pre.victim_key]
        assert victim.preemptible, f"preempted non-preemptible {victim.key}"
        assert victim.job_class is not JobClass.INTERACTIVE, f"preempted interactive {victim.key}"
        assert victim.holds_gpus and not victim.terminating
        started = victim.started_at
        assert started is not None and snapshot.now - started >= victim.min_runtime_s


def check_instant(sim: Simulator, at: float) -> None:
    holders = [j for j in sim.jobs.values() if j.holds_gpus and j.grants]
    for name, node in sim.world.nodes.items():
        grants = [g for j in holders if j.node == name for g in j.grants]
        for free in node.with_grants(grants).free():
            on_gpu = [(j.key, j.phase.value, j.attempts) for j in holders
                      if any(g.gpu_uuid == free.gpu.uuid for g in j.grants)]
            assert free.memory_mib >= 0 and free.cores_pct >= 0, (
                f"GPU {free.gpu.uuid} overbooked at {at} by {on_gpu}")
            exclusive = [g for g in grants if g.gpu_uuid == free.gpu.uuid and g.exclusive]
            assert not exclusive or free.grants == 1, "an exclusive GPU is shared"
    for quota in sim.world.quotas.values():
        mine = [j for j in holders if j.project == quota.name]
        fraction = {j.key: grants_fraction(j.grants, sim.world.nodes[j.node].inventory)
                    for j in mine}
        in_gpus = sum(fraction[j.key] for j in mine if not j.borrowed)
        in_mem = sum(g.memory_mib for j in mine if not j.borrowed for g in j.grants)
        all_gpus = sum(fraction.values())
        all_mem = sum(g.memory_mib for j in mine for g in j.grants)
        g_gpus = quota.guaranteed_gpus if quota.guaranteed_gpus is not None else math.inf
        g_mem = quota.guaranteed_memory_mib if quota.guaranteed_memory_mib is not None else math.inf
        assert in_gpus <= g_gpus + EPS and in_mem <= g_mem, f"{quota.name} over its guarantee"
        if not quota.borrowing:
            assert all_gpus <= g_gpus + EPS and all_mem <= g_mem, f"{quota.name} over its cap"
        elif quota.borrow_limit_gpus is not None:
            cap = g_gpus + quota.borrow_limit_gpus
            assert all_gpus <= cap + EPS, f"{quota.name} borrows too much"
        if quota.budget_gpu_hours is not None and quota.on_budget_exhausted is BudgetPolicy.HOLD:
            used = project_usage(quota, sim.jobs.values(), at, 1e9).gpu_hours_used
            assert used <= quota.budget_gpu_hours + EPS, (
                f"{quota.name} used {used} of {quota.budget_gpu_hours} GPU-hours at {at}")


def check_conservation(sim: Simulator) -> None:
    jobs = list(sim.jobs.values())
    for job in jobs:
        run = job.current_run
        open_hours = run.fraction * (sim.now - run.start) / HOUR if run else 0.0
        assert math.isclose(job_gpu_hours(job, sim.now), sim.seen_gpu_hours[job.key] + open_hours,
                            rel_tol=1e-9, abs_tol=1e-9)
    totals = project_gpu_hours(jobs, sim.now)
    for project, total in totals.items():
        parts = sum(job_gpu_hours(j, sim.now) for j in jobs if j.project == project)
        assert math.isclose(total, parts, rel_tol=1e-9, abs_tol=1e-12)


def check_deterministic(snapshot: ClusterSnapshot, result: CycleResult, config: AdmissionConfig,
                        seed: int) -> None:
    jobs = list(snapshot.jobs)
    random.Random(seed).shuffle(jobs)
    nodes = dict(reversed(list(snapshot.nodes.items())))
    again = admission_cycle(replace(snapshot, jobs=tuple(jobs), nodes=nodes), config)
    assert again == result, "same snapshot, different decisions"


def play(world: World, seed: int) -> None:
    sim = Simulator(world)
    for step, dt in enumerate(world.steps):
        snapshot = sim.snapshot()
        result = admission_cycle(snapshot, world.config)
        check_cycle(snapshot, result)
        if step < 2:
            check_deterministic(snapshot, result, world.config, seed)
        sim.apply(result)
        check_instant(sim, sim.now)
        sim.advance(dt, lambda at: check_instant(sim, at))
        check_instant(sim, sim.now)
    check_conservation(sim)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.integers(0, 1000))
def test_admission_invariants_hold_over_random_event_sequences(world: World, seed: int) -> None:
    play(world, seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(contended=True), st.integers(0, 1000))
def test_admission_invariants_hold_under_contention_and_preemption(world: World,
                                                                  seed: int) -> None:
    play(world, seed)
