"""ETA: learned durations, remaining time, the occupancy timeline and coarse estimates."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.jobs import DurationEstimate, Job, RunRecord
from carpool.core.placement import NodeState
from carpool.core.resources import (
    GpuGrant,
    GpuRequest,
    Isolation,
    JobClass,
    NodeInventory,
    Phase,
)
from carpool.core.run_times import (
    Z80,
    expected_duration,
    expected_remaining,
    learn_durations,
    learned_remaining,
    remaining,
    update_duration_estimate,
)
from carpool.core.timeline import Occupancy, Timeline, TimelineMemo, fluid_start
from carpool_testbed.builders import GIB, HOUR, gpu_node, packing_placer, packing_score

WHOLE = GpuRequest(1, 0, isolation=Isolation.EXCLUSIVE)

node = gpu_node


def whole(node_name: str, index: int) -> tuple[GpuGrant, ...]:
    return (GpuGrant(f"{node_name}-g{index}", 80 * GIB, 100, exclusive=True),)


def finished(key: str, estimate: float, actual: float, end: float, project: str = "a",
             cls: JobClass = JobClass.SHORT) -> Job:
    return Job(key, project, cls, WHOLE, 0.0, estimate, phase=Phase.SUCCEEDED,
               runs=(RunRecord(1, end - actual, end, 1.0),))


def test_first_runs_are_averaged_then_the_newest_weighs_alpha() -> None:
    # a template that never changes: its first 1/alpha runs weigh equally, so one long run
    # among them moves the estimate by 1/n of its log, not by alpha of it
    runs = [100.0, 400.0, 100.0, 400.0]
    learned = None
    for seconds in runs:
        learned = update_duration_estimate(learned, seconds, seconds, 0.1)
    assert learned is not None
    assert math.exp(learned.log_seconds) == pytest.approx(200.0)  # geometric mean of all four
    for _ in range(6):  # ten runs so far: from now on the newest weighs 0.1
        learned = update_duration_estimate(learned, 200.0, 200.0, 0.1)
    before = learned.log_seconds
    learned = update_duration_estimate(learned, 2000.0, 2000.0, 0.1)
    assert learned.log_seconds == pytest.approx(0.9 * before + 0.1 * math.log(2000.0))


def test_ewma_update() -> None:
    first = update_duration_estimate(None, 100, 50, 0.5)
    assert (first.seconds, first.ratio, first.samples) == (100, 2.0, 1)
    second = update_duration_estimate(first, 200, 200, 0.5)
    assert (second.seconds, second.ratio, second.samples) == (150, 1.5, 2)
    # in log space: the typical run time is the weighted geometric mean
    assert math.exp(second.log_seconds) == pytest.approx(math.sqrt(100 * 200))
    assert second.error_seconds == pytest.approx(math.log(2))  # predicted 100, took 200
    assert second.error_ratio == pytest.approx(math.log(2))  # predicted 2 x 200, took 200
    with pytest.raises(ValueError, match="alpha"):
        update_duration_estimate(None, 1, 1, 0)


def test_learning_is_per_project_and_class_and_order_independent() -> None:
    jobs = [finished("a/1", 100, 200, 1000), finished("a/2", 100, 100, 2000),
            finished("b/1", 100, 50, 1500, project="b"),
            finished("a/3", 100, 300, 3000, cls=JobClass.BATCH)]
    learned = learn_durations(jobs, alpha=0.5)
    assert learned[("a", JobClass.SHORT)].ratio == pytest.approx(0.5 * 1.0 + 0.5 * 2.0)
    assert learned[("b", JobClass.SHORT)].ratio == pytest.approx(0.5)
    assert learned[("a", JobClass.BATCH)].samples == 1
    shuffled = list(jobs)
    random.Random(4).shuffle(shuffled)
    assert learn_durations(shuffled, alpha=0.5) == learned
    running = Job("a/r", "a", JobClass.SHORT, WHOLE, 0, 100, phase=Phase.RUNNING,
                  runs=(RunRecord(1, 0, None, 1.0),))
    assert learn_durations([running]) == {}


def test_expected_duration_scales_the_estimate_within_the_limit() -> None:
    learned = {("a", JobClass.SHORT): DurationEstimate(500, 1.5, 3)}
    j = Job("a/x", "a", JobClass.SHORT, WHOLE, 0, 1000, max_duration_s=1200)
    assert expected_duration(j, learned) == 1200  # 1500 capped at maxDuration
    assert expected_duration(j, {}) == 1000
    other = Job("a/y", "a", JobClass.BATCH, WHOLE, 0, 1000)
    assert expected_duration(other, learned) == 1000


def test_expected_remaining() -> None:
    j = Job("a/x", "a", JobClass.SHORT, WHOLE, 0, 1000, max_duration_s=2000,
            phase=Phase.RUNNING, runs=(RunRecord(1, 100, None, 1.0),))
    assert expected_remaining(j, 400, 1000, 60) == 700
    # past its expectation: half the 1400 s it has run, but never past its maxDuration
    assert expected_remaining(j, 1500, 1000, 60) == 600
    assert expected_remaining(j, 1150, 1000, 60) == 525
    assert expected_remaining(j, 200, 50, 60) == 60  # at least a minute
    assert expected_remaining(j, 2095, 1000, 60) == 5  # its maxDuration stops it in 5 s
    assert expected_remaining(j, 2200, 1000, 60) == 60  # past its limit: ends any moment
    queued = Job("a/q", "a", JobClass.SHORT, WHOLE, 0, 1000)
    assert expected_remaining(queued, 400, 1000, 60) == 1000


def test_a_silent_job_within_its_run_time_ends_when_a_typical_run_would() -> None:
    found = learned_remaining((500, 1000, 2000), 400)
    assert (found.expected, found.low, found.high) == (600, 100, 1600)


def test_a_silent_job_past_its_run_time_goes_on_as_the_longer_runs_did() -> None:
    sigma = 0.5  # P90 = expected x e^(Z80 sigma)
    run_time = (1000 * math.exp(-Z80 * sigma), 1000, 1000 * math.exp(Z80 * sigma))
    # at its expected run time, half its kind's runs are longer: their median is the 75th
    # percentile, e^(0.6745 sigma) x 1000
    at_median = learned_remaining(run_time, 1000)
    assert at_median.expected == pytest.approx(1000 * (math.exp(0.67449 * sigma) - 1), rel=1e-3)
    assert 0 < at_median.low < at_median.expected < at_median.high
    # further past it, less of what is left is likely, but never nothing
    later = learned_remaining(run_time, 2000)
    assert 0 < later.expected < at_median.expected + 1000
    job = Job("a/x", "a", JobClass.SHORT, WHOLE, 0, 1000, phase=Phase.RUNNING,
              runs=(RunRecord(1, 0, None, 1.0),))
    assert remaining(job, 2000, run_time, 60).expected == pytest.approx(later.expected)
    # without a spread, or far past any run time the spread makes likely: half the time run
    assert remaining(job, 2000, (1000, 1000, 1000), 60).expected == 1000
    assert learned_remaining(run_time, 1e6).expected < 0
    assert remaining(job, 1e6, run_time, 60).expected == 5e5


def test_earliest_slot_waits_for_the_first_gpu_to_free() -> None:
    timeline = Timeline({"n1": node("n1"), "n2": node("n2")}, 0.0, packing_placer)
    timeline.add("n1", Occupancy("x", 0, 500, whole("n1", 0)))
    timeline.add("n1", Occupancy("y", 0, 900, whole("n1", 1)))
    timeline.add("n2", Occupancy("z", 0, 700, whole("n2", 0) + whole("n2", 1)))
    slot = timeline.earliest(WHOLE, 100, 0.0)
    assert slot is not None and (slot.start, slot.node) == (500, "n1")
    assert slot.grants[0].gpu_uuid == "n1-g0"
    two = GpuRequest(2, 0, isolation=Isolation.EXCLUSIVE)
    slot2 = timeline.earliest(two, 100, 0.0)
    assert slot2 is not None and (slot2.start, slot2.node) == (700, "n2")
    late = timeline.earliest(WHOLE, 100, 800.0)
    assert late is not None and late.start == 800


def test_a_reservation_blocks_overlapping_spans_but_not_earlier_holes() -> None:
    timeline = Timeline({"n1": node("n1", gpus=1)}, 0.0, packing_placer)
    timeline.add("n1", Occupancy("big", 1000, 2000, whole("n1", 0)))
    short = timeline.best_now(WHOLE, 900)
    assert short is not None and short.start == 0  # finishes before the reservation
    assert timeline.best_now(WHOLE, 1100) is None  # would delay it
    assert timeline.best_now(WHOLE, 1100, respect_reservations=False) is not None
    slot = timeline.earliest(WHOLE, 1100, 0.0)
    assert slot is not None and slot.start == 2000


def test_end_at_shortens_a_job_and_without_ignores_it() -> None:
    timeline = Timeline({"n1": node("n1", gpus=1)}, 0.0, packing_placer)
    timeline.add("n1", Occupancy("victim", 0, 5000, whole("n1", 0)))
    assert timeline.best_now(WHOLE, 10) is None
    assert timeline.best_now(WHOLE, 10, without=frozenset({"victim"})) is not None
    timeline.end_at("victim", 30)
    slot = timeline.earliest(WHOLE, 10, 0.0)
    assert slot is not None and slot.start == 30


def test_never_fits_and_unknown_nodes() -> None:
    timeline = Timeline({"n1": node("n1", gpus=1)}, 0.0, packing_placer)
    four = GpuRequest(4, 0, isolation=Isolation.EXCLUSIVE)
    assert timeline.never_fits("n1", four) and not timeline.fits_anywhere_ever(four)
    assert timeline.earliest(four, 10, 0.0) is None
    with pytest.raises(KeyError, match="unknown node"):
        timeline.add("nope", Occupancy("x", 0, 1, ()))


def test_packing_score_prefers_the_fuller_node() -> None:
    empty, half = node("a"), node("b").with_grants(whole("b", 0))
    assert packing_score(half, whole("b", 1)) == 1.0
    assert packing_score(empty, whole("a", 0)) == 0.5
    assert packing_score(NodeState(NodeInventory("c", ())), ()) == 0.0


def test_fluid_start_drains_at_cluster_rate() -> None:
    assert fluid_start(100.0, 8.0, 4.0) == pytest.approx(100 + 2 * HOUR)
    assert fluid_start(100.0, 8.0, 0.0) == 100.0


SHARED = [GpuRequest(1, m * GIB, cores_pct=c, isolation=Isolation.MPS)
          for m in (10, 30, 50) for c in (25, 50)] + [WHOLE]


def _scanned(timeline: Timeline, request: GpuRequest, duration: float,
             respect: bool) -> tuple[str, tuple[GpuGrant, ...]] | None:
    """best_now by definition: every node, best score, ties to the first in name order."""
    end = timeline.now + duration if respect else math.nextafter(timeline.now, math.inf)
    best: tuple[float, str, tuple[GpuGrant, ...]] | None = None
    for name in timeline.node_names:
        if timeline.never_fits(name, request):
            continue
        fit = timeline.fit_during(name, request, timeline.now, end)
        if fit is not None and (best is None or fit[0] > best[0]):
            best = (fit[0], name, fit[1])
    return (best[1], best[2]) if best else None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "end", "ask"]), st.integers(0, 5),
                          st.integers(0, len(SHARED) - 1), st.integers(-300, 300),
                          st.integers(1, 600), st.booleans()), max_size=60))
def test_best_now_equals_a_scan_of_every_node(ops: list[tuple[str, int, int, int, int, bool]]
                                              ) -> None:
    """best_now keeps per-request rankings between calls; they must always give what looking
    at every node gives, through admissions, future reservations and shortened jobs."""
    now = 1000.0
    nodes = {f"n{i}": node(f"n{i}", gpus=2) for i in range(6)}
    timeline = Timeline(nodes, now, packing_placer)
    keys: list[str] = []
    for op, n, r, offset, length, respect in ops:
        request = SHARED[r]
        if op == "add":
            start = now + min(0, offset) if offset < 150 else now + offset
            slot = (timeline.best_now(request, length) if start <= now
                    else timeline.earliest(request, length, start))
            if slot is not None:
                key = f"j{len(keys)}"
                keys.append(key)
                timeline.add(slot.node, Occupancy(key, slot.start, slot.start + length,
                                                  slot.grants))
        elif op == "end" and keys:
            timeline.end_at(keys[n % len(keys)], now + offset - 200)  # mostly: gone by now
        else:
            got = timeline.best_now(request, length, respect)
            assert (None if got is None else (got.node, got.grants)) \
                == _scanned(timeline, request, length, respect)


OP = st.tuples(st.sampled_from(["add", "end", "ask"]), st.integers(0, 5),
               st.integers(0, len(SHARED) - 1), st.integers(-300, 300), st.integers(1, 600),
               st.booleans())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(OP, max_size=25), min_size=1, max_size=4), st.integers(1, 3))
def test_rankings_kept_across_cycles_equal_a_scan(
        cycles: list[list[tuple[str, int, int, int, int, bool]]], limit_scale: int) -> None:
    """A memo carries each request's ranking into the next cycle, fitting again only the
    nodes whose state at now changed: through jobs that ended or started between cycles,
    reservations and memo trims, best_now must give what looking at every node gives."""
    nodes = {f"n{i}": node(f"n{i}", gpus=2) for i in range(6)}
    memo = TimelineMemo(limit=40 * limit_scale)
    running: dict[str, tuple[str, float, tuple[GpuGrant, ...]]] = {}  # key -> node, end, grants
    for c, ops in enumerate(cycles):
        now = 1000.0 + 200.0 * c
        timeline = Timeline(nodes, now, packing_placer, memo)
        for key, (name, end, grants) in sorted(running.items()):
            if end > now:  # the same grants tuple each cycle, as the operator reads it
                timeline.add(name, Occupancy(key, now, end, grants))
        for op, n, r, offset, length, respect in ops:
            request = SHARED[r]
            if op == "add":
                start = now if offset < 150 else now + offset
                slot = (timeline.best_now(request, length) if start <= now
                        else timeline.earliest(request, length, start))
                if slot is not None:
                    key = f"c{c}j{n}{r}{offset}"
                    timeline.add(slot.node, Occupancy(key, slot.start, slot.start + length,
                                                      slot.grants))
                    if slot.start <= now:
                        running[key] = (slot.node, slot.start + length, slot.grants)
            elif op == "end" and running:
                key = sorted(running)[n % len(running)]
                timeline.end_at(key, now)
                running.pop(key)
            else:
                got = timeline.best_now(request, length, respect)
                assert (None if got is None else (got.node, got.grants)) \
                    == _scanned(timeline, request, length, respect)
                found = timeline.earliest(request, length, now)
                assert (None if found is None else (found.start, found.node, found.grants)) \
                    == _earliest_scanned(timeline, request, length, now)


def _earliest_scanned(timeline: Timeline, request: GpuRequest, duration: float,
                      not_before: float) -> tuple[float, str, tuple[GpuGrant, ...]] | None:
    """earliest by definition: on every node, the first of `not_before` and the ends after
    it where the job fits; the earliest, then the best score, then the first name."""
    best: tuple[float, float, str, tuple[GpuGrant, ...]] | None = None
    for name in timeline.node_names:
        if timeline.never_fits(name, request):
            continue
        ends = sorted({o.end for o in timeline.occupancies(name) if o.end > not_before})
        for t in [not_before, *ends]:
            fit = timeline.fit_during(name, request, t, t + duration)
            if fit is not None:
                if best is None or (t, -fit[0], name) < best[:3]:
                    best = (t, -fit[0], name, fit[1])
                break
    return None if best is None else (best[0], best[2], best[3])


def test_a_memo_state_made_from_the_one_before_is_the_node_with_every_grant() -> None:
    """The memo makes a node's state with one more job from the state without it where it
    keeps that one (its free GPUs worked out from that one's): the state is still the base
    with every grant, in order, and a grant tuple it did not see makes another state."""
    memo = TimelineMemo()
    base = memo.derived(node("n1", gpus=4))
    held: tuple[tuple[GpuGrant, ...], ...] = ()
    for grants in (whole("n1", 0), (), (GpuGrant("n1-g1", 10 * GIB, 25),
                                        GpuGrant("n1-g2", 10 * GIB, 25)), whole("n1", 3)):
        held = (*held, grants)
        state = memo.state(base, held)
        plain = NodeState(base.inventory, tuple(g for gs in held for g in gs))
        assert NodeState(state.inventory, state.grants) == plain
        assert state.free() == plain.free()
        assert memo.state(base, held) is state
    other = (*held[:-1], whole("n1", 3))  # equal to the last tuple, but another object
    again = memo.state(base, other)
    assert again is not state and again.grants == state.grants


def test_a_full_memo_keeps_what_the_last_cycle_used() -> None:
    placed: list[str] = []

    def counting(state: NodeState, request: GpuRequest
                 ) -> tuple[float, tuple[GpuGrant, ...]] | None:
        placed.append(state.name)
        return packing_placer(state, request)

    nodes = {"n1": node("n1"), "n2": node("n2")}
    request = GpuRequest(1, 40 * GIB, isolation=Isolation.EXCLUSIVE)
    memo = TimelineMemo(limit=1)

    def cycle(*names: str) -> None:
        timeline = Timeline(nodes, 0.0, counting, memo)
        for name in names:
            timeline.fit_during(name, request, 0.0, 3600.0)

    cycle("n1", "n2")
    cycle("n1")  # both answered from the memo; past its limit, only n1's answers are kept
    assert placed == ["n1", "n2"]
    cycle("n1", "n2")
    assert placed == ["n1", "n2", "n2"]
