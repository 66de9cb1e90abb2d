"""The sharing replay (`carpool simulate sharing`): fixed degrees against Carpool's learned
limits and pairs on a generated trace, deterministic per seed."""

from __future__ import annotations

import random

import pytest

from carpool.cli import main as cli
from carpool.core.placement import NodeState, grant_for
from carpool.core.resources import Gpu, NodeInventory
from carpool.replay import sharing_replay as sr

TRUTH = {t.template: t for t in sr.TEMPLATES}


def test_a_job_counts_its_neighbours_as_the_copies_their_loads_make() -> None:
    light, heavy = TRUTH["vision-resnet"], TRUTH["finetune"]
    # among copies: the slowdown per copy, as the degree alone would say
    assert light.throughput([light, light]) == pytest.approx(1 / (1 + 2 * light.slowdown))
    assert light.throughput() == 1.0 and light.p99_s() == light.alone_p99_s
    # one heavy neighbour of ten times its load: as ten copies of itself
    assert light.copies([heavy]) == pytest.approx(10.0)
    assert light.throughput([heavy]) == pytest.approx(1 / (1 + 10 * light.slowdown))
    assert light.p99_s([heavy]) == pytest.approx(
        light.alone_p99_s * (1 + 10 * light.slowdown) * (1 + 10 * light.tail))
    # while the heavy one counts the light one as a tenth of itself
    assert heavy.copies([light]) == pytest.approx(0.1)
    assert heavy.throughput([light]) > 0.95
    # so beside one heavy job the light service breaks a target that a copy of it keeps
    target = 3 * light.alone_p99_s
    assert light.p99_s([light]) < target < light.p99_s([heavy])


def test_pairs_are_learned_from_the_reports_and_keep_services_from_heavy_jobs() -> None:
    trace = sr.generate(120, seed=3, interarrival_s=120.0)
    replay = sr._Replay(trace, 8, None, seed=3, profile_degrees=6)
    scores = replay.run("carpool")
    assert scores.profiles == len(sr.TEMPLATES) and scores.pairs > 0
    assert scores.violation_minutes_unprofiled == 0  # every template profiled first
    light = replay.profiles.get(sr.MODEL, "vision-resnet")
    assert light is not None
    pairs = dict(light.pairs)
    # learned from what it reported beside them, near the truth's load ratios: a heavy
    # neighbour as many copies, a lighter service as under one
    assert pairs["finetune"] > 5 and pairs.get("ranker", 0.0) < 1.5
    # every violation was beside a neighbour no pair had been measured for yet
    assert scores.violation_minutes == scores.violation_minutes_unpaired
    # the same trace learned by weight only learns no pair, and counts the heavy job as
    # about one copy of the light service
    weighed = sr._Replay(trace, 8, None, seed=3, by_weight_only=True, profile_degrees=6)
    weighed.run("carpool-by-weight")
    assert all(not p.pairs for p in weighed.profiles.by_key.values())
    assert weighed.profiles.get(sr.MODEL, "finetune") is not None


def test_truth_is_hidden_but_learned() -> None:
    trace = sr.generate(120, seed=3, interarrival_s=120.0)
    assert trace == sr.generate(120, seed=3, interarrival_s=120.0)
    services = [j for j in trace if j.p99_target_s is not None]
    assert services and len(services) < len(trace)
    alone = sr.replay(trace, 8, "fixed-1", seed=3)
    assert alone.violation_minutes == 0  # running alone keeps every target
    packed = sr.replay(trace, 8, "fixed-6", seed=3)
    assert packed.violation_share > 0.5 and packed.work_per_hour > alone.work_per_hour
    carpool = sr.replay(trace, 8, "carpool", seed=3, profile_degrees=6)
    fixed2 = sr.replay(trace, 8, "fixed-2", seed=3)
    assert carpool.violation_share < fixed2.violation_share / 2
    assert carpool.work_per_hour > alone.work_per_hour
    with pytest.raises(ValueError, match="unknown policy"):
        sr.replay(trace, 8, "fixed-9")


def test_reports_name_the_neighbours_as_their_grants_do() -> None:
    jobs = [sr.TraceJob(f"{t.template}-{n}", t, 0.0, 600.0, None)
            for n, t in enumerate((TRUTH["finetune"], TRUTH["ranker"]))]
    replay = sr._Replay(sr.generate(10, seed=1), 1, None, seed=1, profile_degrees=2)
    replay.relearn()
    # no profile yet: the request of its shape, unnamed
    assert replay.request(jobs[0]).sharing_template == ""
    replay.profile(random.Random(1))
    replay.relearn()
    state = NodeState(NodeInventory("n", (Gpu(0, "gpu-0", sr.MODEL, sr.GPU_MEMORY_MIB),)))
    running = []
    for job in jobs:
        grant = grant_for(state.free()[0], replay.request(job))
        state = state.with_grants([grant])
        running.append(sr._Running(job, 0, grant, 0.0))
    sample = replay.sample(running[1], [running[0]], 0.5, 0.01, 7)
    assert sample.template == "ranker" and sample.neighbours == ("finetune",)
    assert sample.degree == 2 and sample.company == "gpu-0@7"
    # profiled, finetune keeps no limit (its curve still climbs) but is named
    assert replay.request(jobs[0]).sharing_limits == ()
    assert replay.request(jobs[0]).sharing_template == "finetune"


def test_the_command_prints_one_line_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "sharing", "--generate", "60", "--gpus", "4", "--policy",
                     "fixed-1,carpool,carpool-by-weight", "--profile-degrees", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("60 generated jobs") and "profiled at 1-2 jobs" in out[0]
    assert out[1].split()[0] == "POLICY"
    assert [line.split()[0] for line in out[2:]] == ["fixed-1", "carpool", "carpool-by-weight"]
