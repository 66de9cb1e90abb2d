"""Interference profiles (`core.interference`) and the sharing limits placement takes from
them: a job's objective, or the knee of the throughput curve, caps how many jobs its GPU
carries; without a profile placement is what it always was."""

from __future__ import annotations

from dataclasses import replace

import pytest

from carpool.core import interference as inf
from carpool.core import service_levels as levels
from carpool.core.derived import DerivedState
from carpool.core.gpu_choice import NoFit, choose_gpus
from carpool.core.jobs import ClusterSnapshot, Job, RunRecord
from carpool.core.placement import (
    NodeState,
    gpu_rejection,
    grant_for,
    node_rejection,
    sharing_cost,
)
from carpool.core.queueing import AdmissionConfig, WaitReason, admission_cycle
from carpool.core.resources import Gpu, GpuGrant, GpuRequest, NodeInventory, Objectives, Phase
from carpool.core.scoring import RequestScorer, Scorer
from carpool_testbed.builders import GIB, gpu_job, packing_placer, project_quota

# ResNet-like: per-job throughput and P99 by degree (the GPU's total flattens after 3)
RESNET = {1: (227.0, 0.0068), 2: (200.0, 0.0090), 3: (160.0, 0.0150), 4: (125.0, 0.0300),
          5: (100.0, 0.0700)}


def samples(curve: dict[int, tuple[float, float]], template: str = "resnet",
            model: str = "H200") -> list[inf.Sample]:
    return [inf.Sample(model, template, d, t, p) for d, (t, p) in curve.items()]


def test_a_profile_needs_two_degrees_and_takes_medians_and_high_tails() -> None:
    assert inf.learn(samples({1: (227.0, 0.007)})).get("H200", "resnet") is None
    profile = inf.learn([*samples({1: (220.0, 0.007), 2: (200.0, 0.009)}),
                         inf.Sample("H200", "resnet", 1, 234.0, 0.005),
                         inf.Sample("H200", "resnet", 1, 100.0, None),
                         inf.Sample("", "resnet", 1, 1.0, 1.0)]).get("H200", "resnet")
    assert profile is not None
    one = profile.point(1)
    # the median throughput; the P99 of the worse reports (TAIL_QUANTILE), whatever the company
    assert one is not None and (one.throughput, one.samples) == (220.0, 3)
    assert one.p99_s == pytest.approx(0.0068)  # 90 % of the way from 0.005 to 0.007


def test_one_outlier_among_few_reports_does_not_set_a_degrees_tail() -> None:
    # nine reports alone, eight near 1.1 ms and one at 2.13 ms; a 2.29 ms target
    alone = [0.00102, 0.00104, 0.00106, 0.00108, 0.00110, 0.00112, 0.00114, 0.00115, 0.00213]
    reports = [inf.Sample("H100", "encoder", 1, 900.0, p) for p in alone]
    reports += [inf.Sample("H100", "encoder", 3, 600.0, 0.0019) for _ in range(3)]
    profile = inf.learn(reports).get("H100", "encoder")
    assert profile is not None
    one = profile.point(1)
    assert one is not None and one.p99_s == pytest.approx(0.001346)
    # degree 4, one beyond the measured, read along 1 and 3: 2.18 ms, over the 2.06 ms the
    # headroom leaves; the curve crosses it 58 % of the way from 3
    assert profile.limit(Objectives(p99_latency_s=0.00229)) == 3.58
    # many reports over the target at a degree still break it there
    worse = inf.learn([*reports, *(inf.Sample("H100", "encoder", 1, 900.0, 0.0025)
                                   for _ in range(3))]).get("H100", "encoder")
    assert worse is not None and worse.limit(Objectives(p99_latency_s=0.00229)) == 1


def test_the_knee_is_where_one_more_job_adds_under_a_tenth() -> None:
    profile = inf.learn(samples(RESNET)).get("H200", "resnet")
    assert profile is not None
    # totals 227, 400, 480, 500, 500: 3 -> 4 adds 4 %
    assert profile.knee() == 3
    assert profile.limit(None) == 3
    climbing = inf.learn(samples({1: (100.0, 0.01), 2: (95.0, 0.011)})).get("H200", "resnet")
    assert climbing is not None and climbing.knee() is None  # still climbing: no limit yet


def test_an_objective_caps_the_degree_where_its_profile_keeps_it() -> None:
    profile = inf.learn(samples(RESNET)).get("H200", "resnet")
    assert profile is not None
    # 18 ms with the headroom: 15 ms at 3, 30 ms at 4, crossed a fifth of the way
    assert profile.limit(Objectives(p99_latency_s=0.020)) == 3.2
    assert profile.limit(Objectives(p99_latency_s=0.010)) == 2  # 9 ms at 2: no further
    assert profile.limit(Objectives(p99_latency_s=0.001)) == 1  # even alone: run alone
    # 227/1.5 = 151.3 req/s at the least: 160 at 3, 125 at 4
    assert profile.limit(Objectives(max_slowdown=1.5)) == 3.24
    assert profile.limit(Objectives(p99_latency_s=1.0)) == 6  # one beyond what was measured


def test_limits_per_model_and_the_request_they_give() -> None:
    profiles = inf.learn([*samples(RESNET), *samples(RESNET, model="A100"),
                          *samples(RESNET, template="bert")])
    assert profiles.limits("resnet", Objectives(0.010)) == (("A100", 2), ("H200", 2))
    request = GpuRequest(1, GIB, 25, objectives=Objectives(0.010))
    assert inf.limited(request, "resnet", profiles).sharing_limit("H200") == 2
    # no profile: the request of its shape, unnamed (the placement memos share it)
    assert inf.limited(request, "unknown", profiles) is request
    assert inf.limited(request, "resnet", inf.NO_PROFILES) is request


def h200(*grants: GpuGrant) -> NodeState:
    return NodeState(NodeInventory("n1", (Gpu(0, "g0", "H200", 140 * GIB),)), grants)


def test_placement_keeps_a_gpu_within_its_jobs_and_the_newcomers_limits() -> None:
    limited = GpuRequest(1, GIB, 10, sharing_limits=(("H200", 2),))
    free = GpuRequest(1, GIB, 10)
    one = GpuGrant("g0", GIB, 10)
    # the newcomer's own limit: a third job would break its objective
    assert node_rejection(h200(one), limited) is None
    why = node_rejection(h200(one, one), limited)
    assert why is not None and "sharing it by 3 would break this job's objective" in why
    # a job there with a limit of 2 keeps every newcomer off once it has company
    held = grant_for(h200().free()[0], limited)
    assert held.sharing_limit == 2
    assert gpu_rejection(h200(held).free()[0], free) is None
    why = gpu_rejection(h200(held, one).free()[0], free)
    assert why is not None and "objective of a job there" in why
    # the GPU choice (its fast path included) agrees with the filter
    scorer = RequestScorer(limited, Scorer())
    assert isinstance(choose_gpus(DerivedState.of(h200(one, one)), scorer), NoFit)
    assert isinstance(choose_gpus(DerivedState.of(h200(held, one)),
                                  RequestScorer(free, Scorer())), NoFit)
    assert not isinstance(choose_gpus(DerivedState.of(h200(one, one)),
                                      RequestScorer(free, Scorer())), NoFit)


def test_a_sharing_weight_is_the_share_of_the_gpu_a_job_takes_alone() -> None:
    profiles = inf.learn([*samples(RESNET), *samples({1: (50.0, 0.02), 2: (25.0, 0.04)},
                                                      template="saturating")])
    resnet, saturating = profiles.get("H200", "resnet"), profiles.get("H200", "saturating")
    assert resnet is not None and saturating is not None
    assert resnet.weight() == 454  # 227 alone of the 500 its jobs got together at most
    assert saturating.weight() == 1000  # sharing adds nothing: it takes the whole GPU alone
    light = inf.learn(samples({1: (10.0, 0.01), 2: (10.0, 0.01), 3: (10.0, 0.01)},
                              template="light")).get("H200", "light")
    assert light is not None and light.weight() == 333
    request = GpuRequest(1, GIB, 25, objectives=Objectives(0.010))
    weighed = inf.limited(request, "resnet", profiles)
    assert weighed.sharing_weights == (("H200", 454),) and weighed.sharing_weight("A100") == 1000
    assert grant_for(h200().free()[0], weighed).sharing_weight == 454


def test_a_job_counts_each_neighbour_as_the_copies_of_itself_its_weight_makes() -> None:
    heavy = GpuRequest(1, GIB, 0, sharing_limits=(("H200", 2),), sharing_weights=(("H200", 1000),))
    light = GpuRequest(1, GIB, 0, sharing_limits=(("H200", 6),), sharing_weights=(("H200", 250),))
    batch = replace(light, sharing_limits=())  # as light, without an objective
    heavy_held, light_held, batch_held = (grant_for(h200().free()[0], r)
                                          for r in (heavy, light, batch))
    # the heavy service's limit of 2 was measured with a copy of itself: four light
    # neighbours press on it as much as that one (1 + 4 x 0.25 = 2), a fifth is too many
    assert gpu_rejection(h200(heavy_held, *[batch_held] * 3).free()[0], batch) is None
    why = gpu_rejection(h200(heavy_held, *[batch_held] * 4).free()[0], batch)
    assert why is not None and "objective of a job there" in why
    assert "counted by weight: 2.25" in why
    assert gpu_rejection(h200(*[batch_held] * 4).free()[0], heavy) is None
    why = gpu_rejection(h200(*[batch_held] * 5).free()[0], heavy)
    assert why is not None and "this job's objective" in why
    # the light service's limit of 6 was measured with five copies of itself: one heavy
    # neighbour presses on it like four of them, so beside it the light one takes one more
    # light job only (1 + 4 + 1 = 6), where copies alone would take five
    assert gpu_rejection(h200(heavy_held).free()[0], light) is None
    assert gpu_rejection(h200(heavy_held, light_held).free()[0], light) is None
    why = gpu_rejection(h200(heavy_held, light_held, light_held).free()[0], light)
    assert why is not None and "this job's objective" in why
    assert "counted by weight: 7.00" in why
    assert gpu_rejection(h200(*[light_held] * 5).free()[0], light) is None
    # a job without a profile weighs a whole GPU: it counts as that many copies
    unprofiled = GpuGrant("g0", GIB, 0)  # weighs WHOLE_SHARER
    light8 = replace(light, sharing_limits=(("H200", 9),))
    assert gpu_rejection(h200(unprofiled, unprofiled).free()[0], light8) is None
    why = gpu_rejection(h200(*[unprofiled] * 3).free()[0], light8)
    assert why is not None and "sharing it by 4 would break this job's objective" in why
    # with weights alike, the count is the count of jobs
    assert gpu_rejection(h200(heavy_held).free()[0], heavy) is None
    why = gpu_rejection(h200(heavy_held, heavy_held).free()[0], heavy)
    assert why is not None and "counted by weight" not in why


def test_a_limit_between_two_degrees_takes_a_light_neighbour_but_not_a_copy() -> None:
    # a batch-8 encoder's tail with copies on an H100 (ms): 0.40 alone, 0.73 at 2, over the
    # 0.72 a 0.8 ms target leaves; the curve crosses it 96 % of the way to 2
    profile = inf.learn(samples({1: (2634.0, 0.00040), 2: (1510.0, 0.00073)},
                                template="encoder-b8")).get("H200", "encoder-b8")
    assert profile is not None
    limit = profile.limit(Objectives(p99_latency_s=0.0008))
    assert limit == 1.96
    strict = GpuRequest(1, GIB, 0, sharing_limits=(("H200", limit),),
                        sharing_weights=(("H200", 862),))
    held = grant_for(h200().free()[0], strict)
    assert held.sharing_limit == 1.96
    light = GpuRequest(1, GIB, 0, sharing_weights=(("H200", 424),))  # weighs 0.49 of it
    assert gpu_rejection(h200(held).free()[0], light) is None
    why = gpu_rejection(h200(held).free()[0], replace(light, sharing_weights=(("H200", 862),)))
    assert why is not None and "its profile allows 1.96" in why
    # two light neighbours count as 1.98 of it: one too many
    assert gpu_rejection(h200(held, grant_for(h200().free()[0], light)).free()[0],
                         light) is not None


def test_copies_reporting_from_one_gpu_count_once_against_a_report_in_heavier_company() -> None:
    # a batch-1 encoder profiled with five copies on one GPU (about 0.63 ms each), then one
    # of its services reporting 1.44 ms at the same counted degree beside batch-32 jobs
    copies = [inf.Sample("H100", "encoder-b1", 5, 1700.0, p, "profile x5")
              for p in (0.00061, 0.00062, 0.00063, 0.00064, 0.00065)]
    alone = [inf.Sample("H100", "encoder-b1", 1, 3700.0, 0.00027, "profile x1")]
    beside_heavy = inf.Sample("H100", "encoder-b1", 5, 900.0, 0.00144, "learning GPU 1")
    profile = inf.learn([*alone, *copies, beside_heavy]).get("H100", "encoder-b1")
    assert profile is not None
    # two companies at degree 5: their 90th percentile lies 90 % of the way to the heavy one
    assert profile.p99_at(5) == pytest.approx(0.00063 + 0.9 * (0.00144 - 0.00063))
    assert profile.limit(Objectives(p99_latency_s=0.00136)) < 5
    # as six reports of their own, the copies outvote it and the limit passes 5
    outvoted = inf.learn([replace(s, company="") for s in (*alone, *copies, beside_heavy)]
                         ).get("H100", "encoder-b1")
    assert outvoted is not None and outvoted.limit(Objectives(p99_latency_s=0.00136)) > 5


def test_a_gpujobs_report_names_its_gpu_and_minute_as_its_company() -> None:
    report = levels.ServiceReport(600.0, 10.0, 100, 0,
                                          levels.Histogram.of([0.002] * 100))
    status = {"gpus": [{"uuid": "GPU-1"}], **levels.service_status(
        levels.ServiceMeasure(report, 1, "H100", 2))}
    gpujob = {"metadata": {"name": "web-1"}, "spec": {}, "status": status}
    sample = inf.sample_of(gpujob)
    assert sample is not None and sample.company == "GPU-1@10"
    del status["gpus"]
    sample = inf.sample_of(gpujob)
    assert sample is not None and sample.company == ""


def test_a_report_counts_at_the_degree_its_company_weighs() -> None:
    assert inf.report_degree(3, None) == 3  # recorded before weights: the jobs
    assert inf.report_degree(3, 6.6) == 7  # a light job beside heavy ones
    assert inf.report_degree(3, 1.4) == 1  # a heavy job beside light ones
    assert inf.report_degree(0, None) == 1


def test_a_job_blocked_only_by_sharing_waits_with_its_own_reason() -> None:
    node = h200()
    limit = (("H200", 2),)

    def running(key: str) -> Job:
        j = gpu_job(key, exclusive=False, memory_gib=1)
        return replace(j, phase=Phase.RUNNING, node="n1", attempts=1,
                       grants=(GpuGrant("g0", GIB, 0, sharing_limit=2),),
                       runs=(RunRecord(1, 0.0, None, 0.1),),
                       request=replace(j.request, sharing_limits=limit))
    waiting = gpu_job("a/new", exclusive=False, memory_gib=1, submitted=5.0)
    result = admission_cycle(ClusterSnapshot(10.0, (running("a/one"), running("a/two"), waiting),
                                             {"a": project_quota("a")}, {"n1": node}),
                             AdmissionConfig(node_placer=packing_placer))
    wait = result.wait_for("a/new")
    assert wait is not None and wait.reason is WaitReason.SHARING_OBJECTIVE
    assert "would break the objective of a job there" in wait.message
    # without the limits on the jobs there, it is admitted
    plain = admission_cycle(ClusterSnapshot(10.0, (
        replace(running("a/one"), grants=(GpuGrant("g0", GIB, 0),)),
        replace(running("a/two"), grants=(GpuGrant("g0", GIB, 0),)), waiting),
        {"a": project_quota("a")}, {"n1": node}), AdmissionConfig(node_placer=packing_placer))
    assert [a.job_key for a in plain.admissions] == ["a/new"]


def test_profiles_are_learned_from_recorded_measures() -> None:
    def gpujob(name: str, degree: int, throughput: float) -> dict[str, object]:
        report = levels.ServiceReport(0.0, 10.0, int(throughput * 10), 0,
                                      levels.Histogram.of([0.01] * 10))
        return {"metadata": {"namespace": "s", "name": name},
                "spec": {"template": {"spec": {"containers": [{"image": "resnet:1"}]}}},
                "status": levels.service_status(levels.ServiceMeasure(report, 1, "H200",
                                                                      degree))}
    profiles = inf.learn_from_gpujobs([gpujob("web-1", 1, 200.0), gpujob("web-2", 2, 190.0),
                                       {"metadata": {"name": "idle"}, "status": {}}])
    profile = profiles.get("H200", "web@resnet:1")
    assert profile is not None and [p.degree for p in profile.points] == [1, 2]
    assert profile.throughput_at(2) == pytest.approx(190.0)


def test_a_degree_measured_quieter_than_the_one_before_pools_with_it() -> None:
    assert inf._non_decreasing([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert inf._non_decreasing([1.0, 3.0, 2.0], [1, 1, 3]) == [1.0, 2.25, 2.25]
    assert inf._non_decreasing([5.0, 1.0, 1.0], [1, 1, 1]) == pytest.approx([7 / 3] * 3)
    # a batch-1 ResNet's reports (ms) on an H100, one short run per degree, target 14.87 ms:
    # degree 5's two loud reports put its tail over the target's headroom (13.4 ms) while
    # degree 6, measured with more copies, is well under it
    reports = {1: [7.1, 7.4, 8.0], 2: [7.9, 9.6], 3: [6.5, 9.2, 10.4],
               4: [7.0, 7.4, 7.4, 7.5, 8.0, 8.3, 8.6, 9.8], 5: [7.4, 9.6, 10.3, 13.5, 14.1],
               6: [7.3, 8.0, 8.6, 8.6, 10.8, 13.2]}
    profile = inf.learn([inf.Sample("H100", "resnet-b1", d, 150.0 / d, ms / 1000)
                         for d, values in reports.items() for ms in values]
                        ).get("H100", "resnet-b1")
    assert profile is not None
    tails = [p.p99_s for p in profile.points]
    assert tails == sorted(tails)  # never lower at a higher degree
    assert inf._high([x / 1000 for x in reports[5]]) > 0.01487 * inf.P99_HEADROOM
    assert profile.limit(Objectives(p99_latency_s=0.01487)) == 7  # 6 measured, one beyond
    # a degree that many reports put over the target still caps the limit
    loud = inf.learn([*(inf.Sample("H100", "resnet-b1", d, 150.0 / d, ms / 1000)
                        for d, values in reports.items() for ms in values),
                      *(inf.Sample("H100", "resnet-b1", 5, 30.0, 0.0146) for _ in range(6))]
                     ).get("H100", "resnet-b1")
    assert loud is not None and loud.limit(Objectives(p99_latency_s=0.01487)) == 4.93


# a batch-1 ResNet offered a third of its rate alone, with copies (H100, ms): its P99 barely
# rises; beside one batch-32 job it rises as with many copies
LIGHT = {1: (300.0, 0.0027), 2: (290.0, 0.0030), 3: (283.0, 0.0035), 4: (291.0, 0.0038),
         5: (296.0, 0.0045), 6: (297.0, 0.0047)}
HEAVY = {1: (106.0, 0.0098), 2: (107.0, 0.0150), 3: (108.0, 0.030), 4: (98.0, 0.20)}


def paired(light_p99: float, heavy_p99: float = 0.011, company: str = "gpu-0@1"
           ) -> list[inf.Sample]:
    """A light and a heavy service reporting from one GPU, each naming the other."""
    return [inf.Sample("H100", "light", 2, 290.0, light_p99, company, ("heavy",)),
            inf.Sample("H100", "heavy", 2, 106.0, heavy_p99, company, ("light",))]


def test_a_report_beside_another_template_teaches_the_pair_not_its_own_curve() -> None:
    copies = [*samples(LIGHT, "light", "H100"), *samples(HEAVY, "heavy", "H100")]
    profiles = inf.learn([*copies, *paired(0.0070), *paired(0.0080, company="gpu-1@1")])
    light, heavy = profiles.get("H100", "light"), profiles.get("H100", "heavy")
    assert light is not None and heavy is not None
    # its own curve is its copies' alone: 6 copies keep a 5.35 ms target (4.82 with headroom),
    # and along the last two degrees the curve crosses it 57 % of the way to 7
    two = light.point(2)
    assert two is not None and two.p99_s == pytest.approx(0.0030)
    assert light.limit(Objectives(0.00535)) == 6.57
    # 7-8 ms is beyond six copies: along the last two degrees (0.2 ms a copy) 17.5-22.5 copies,
    # capped at MAX_DEGREE; the heavy one counts as what lies beyond the light one itself
    assert light.degree_of_p99(0.0070) == inf.MAX_DEGREE
    assert light.degree_of_p99(0.0046) == pytest.approx(5.5)
    assert light.degree_of_p99(0.0010) == 1
    assert dict(light.pairs) == {"heavy": inf.MAX_DEGREE - 1}
    # the heavy one beside the light one: 11 ms is 1.23 copies of itself, 0.23 beyond it
    assert dict(heavy.pairs) == {"light": pytest.approx(0.23, abs=0.01)}
    # what each job carries: how every template measured beside it counts it
    assert profiles.felt_by("heavy") == (("H100", (("light", 15.0),)),)
    assert profiles.felt_by("light") == (("H100", (("heavy", pytest.approx(0.23, abs=0.01)),)),)
    # the same reports named no company: counted by weight into the light one's own curve, they
    # lift it at their degree, and its limit falls (what pairs keep apart)
    unnamed = inf.learn([*copies, *(replace(s, neighbours=()) for s in
                                    [*paired(0.0070), *paired(0.0080, company="gpu-1@1")])])
    light_unnamed = unnamed.get("H100", "light")
    assert light_unnamed is not None and light_unnamed.pairs == ()
    assert light_unnamed.limit(Objectives(0.00535)) < 2


def test_a_measured_pair_keeps_a_light_service_from_a_heavy_one_and_with_its_like() -> None:
    copies = [*samples(LIGHT, "light", "H100"), *samples(HEAVY, "heavy", "H100")]
    profiles = inf.learn([*copies, *paired(0.0070)])
    light = inf.limited(GpuRequest(1, GIB, 0, objectives=Objectives(0.00535)), "light",
                        profiles)
    heavy = inf.limited(GpuRequest(1, GIB, 0, objectives=Objectives(0.049)), "heavy", profiles)
    assert light.sharing_template == "light" and heavy.sharing_template == "heavy"
    # measured on H100s; the test's GPU is an H200 of the builder: the same pairs there
    light, heavy = (replace(r, sharing_limits=tuple(("H200", x) for _, x in r.sharing_limits),
                            sharing_weights=tuple(("H200", x) for _, x in r.sharing_weights),
                            sharing_felt_by=tuple(("H200", x) for _, x in r.sharing_felt_by))
                    for r in (light, heavy))
    light_held, heavy_held = (grant_for(h200().free()[0], r) for r in (light, heavy))
    assert heavy_held.sharing_template == "heavy" and heavy_held.sharing_felt_by
    # beside the heavy one the light service counts 15 copies: over its limit of 6, either way
    why = gpu_rejection(h200(heavy_held).free()[0], light)
    assert why is not None and "this job's objective" in why
    assert "counted by measured pairs and weight: 16.00" in why
    why = gpu_rejection(h200(light_held).free()[0], heavy)
    assert why is not None and "objective of a job there" in why
    # by weight alone it would have counted the heavy one as under two copies, and taken it
    unpaired = replace(heavy_held, sharing_felt_by=())
    assert gpu_rejection(h200(unpaired).free()[0], light) is None
    # copies of itself count one each: five of them are fine
    assert gpu_rejection(h200(*[light_held] * 5).free()[0], light) is None
    # the heavy one counts the light one as 0.23 of a copy, as measured (by weight: 0.62)
    assert gpu_rejection(h200(heavy_held, heavy_held).free()[0], replace(
        light, sharing_limits=())) is None


def test_a_company_of_several_templates_blames_only_what_was_not_measured_alone() -> None:
    copies = [*samples(LIGHT, "light", "H100"), *samples(HEAVY, "heavy", "H100"),
              *samples(LIGHT, "other-light", "H100")]
    # beside the heavy one alone the light service reached 3.5 ms: 3 copies of itself, so
    # the heavy one counts as 2; beside both the heavy one and another light template it
    # reached 3.8 ms, 4 copies: what lies beyond the heavy one's 2 is the other light one's
    reports = [inf.Sample("H100", "light", 2, 290.0, 0.0035, "gpu-0@1", ("heavy",)),
               inf.Sample("H100", "light", 3, 290.0, 0.0038, "gpu-1@1",
                          ("heavy", "other-light"))]
    light = inf.learn([*copies, *reports]).get("H100", "light")
    assert light is not None
    assert dict(light.pairs) == {"heavy": 2.0, "other-light": 1.0}
    # shared by weight alone, the second GPU would have blamed the light neighbour for part
    # of the heavy one's delay (the heavy one weighs 270 of the light one's 168)
    only_mixed = inf.learn([*copies, reports[1]]).get("H100", "light")
    assert only_mixed is not None
    assert dict(only_mixed.pairs)["other-light"] == pytest.approx(1.15, abs=0.01)


def test_a_crowd_of_neighbours_each_cheap_alone_raises_what_they_count() -> None:
    copies = [*samples(LIGHT, "light", "H100"), *samples(LIGHT, "mid", "H100"),
              *samples(LIGHT, "other", "H100")]
    # measured alone beside it, each neighbour left the light service at 2.7 ms: its P99
    # alone, so each counts the floor (MIN_PAIR_COUNT)
    pairs = [inf.Sample("H100", "light", 2, 290.0, 0.0027, f"pair-{t}", (t,))
             for t in ("mid", "other")]
    # but two of each beside it took it to 4.6 ms: 5.5 copies of itself, 4.3 beyond the four
    # neighbours' 0.2, shared by weight (alike here) on top of what each counts
    crowd = [inf.Sample("H100", "light", 5, 250.0, 0.0046, "gpu-0@1",
                        ("mid", "mid", "other", "other"))]
    alone = inf.learn([*copies, *pairs]).get("H100", "light")
    assert alone is not None
    assert dict(alone.pairs) == {"mid": inf.MIN_PAIR_COUNT, "other": inf.MIN_PAIR_COUNT}
    crowded = inf.learn([*copies, *pairs, *crowd]).get("H100", "light")
    assert crowded is not None
    assert dict(crowded.pairs) == {"mid": pytest.approx(1.12, abs=0.01),
                                    "other": pytest.approx(1.12, abs=0.01)}
    # a company that stayed within its counts changes nothing
    calm = [replace(crowd[0], p99_s=0.0027)]
    assert inf.learn([*copies, *pairs, *calm]).get("H100", "light") == alone


def test_a_limited_job_chooses_the_gpu_whose_company_is_most_like_its_own_copies() -> None:
    """Among GPUs that all accept it, a light service joins its like rather than a heavy job
    that presses on it like three copies of itself, and takes an untouched GPU rather than
    such company; the choice is the placement core's, so the filter, the extender's bind and
    the operator's timeline pin the same GPU."""
    def service(template: str, limit: float, weight: int, felt: tuple[tuple[str, float], ...]
                ) -> GpuRequest:
        return GpuRequest(1, GIB, 0, sharing_limits=(("H200", limit),),
                          sharing_weights=(("H200", weight),), sharing_template=template,
                          sharing_felt_by=(("H200", felt),))

    # the heavy job counts as 3 copies of the light one, the light one as 0.2 of the heavy
    light = service("light", 6, 200, (("heavy", 0.2),))
    heavy = service("heavy", 3, 800, (("light", 3.0),))
    gpus = tuple(Gpu(i, f"g{i}", "H200", 140 * GIB) for i in range(3))
    empty = NodeState(NodeInventory("n1", gpus))
    frees = empty.free()
    state = empty.with_grants([grant_for(frees[0], heavy), grant_for(frees[1], light)])
    frees = state.free()
    # beside the other template: (0.2 + 3) / 2; beside a copy: 1; untouched: 1
    assert [float(sharing_cost(f, light)) for f in frees] == [pytest.approx(1.6), 1, 1]
    assert [float(sharing_cost(f, heavy)) for f in frees] == [1, pytest.approx(1.6), 1]
    # every GPU accepts both; the memory scorer alone would take GPU 0 (equal slots)
    assert all(gpu_rejection(f, r) is None for f in frees for r in (light, heavy))
    assert choose_gpus(DerivedState.of(state), RequestScorer(light, Scorer()))[1] == (1,)
    assert choose_gpus(DerivedState.of(state), RequestScorer(heavy, Scorer()))[1] == (0,)
    # a job without limits keeps the scorer's choice
    plain = GpuRequest(1, GIB, 0)
    assert choose_gpus(DerivedState.of(state), RequestScorer(plain, Scorer()))[1] == (0,)
    # beside only the heavy one, the light service takes an untouched GPU; with none left,
    # the heavy one's company, which its limit allows
    alone = empty.with_grants([grant_for(empty.free()[0], heavy)])
    assert choose_gpus(DerivedState.of(alone), RequestScorer(plain, Scorer()))[1] == (0,)
    assert choose_gpus(DerivedState.of(alone), RequestScorer(light, Scorer()))[1] == (1,)
    full = NodeState(NodeInventory("n1", gpus[:1]), alone.grants)
    assert choose_gpus(DerivedState.of(full), RequestScorer(light, Scorer()))[1] == (0,)


def test_a_job_without_a_limit_is_named_so_pairs_are_learned_about_it() -> None:
    # a batch job without objectives whose curve still climbs: no knee, no limit of its own
    batch = {1: (100.0, 0.5), 2: (95.0, 0.55)}
    copies = [*samples(LIGHT, "light", "H100"), *samples(batch, "batch", "H100")]
    profiles = inf.learn(copies)
    request = inf.limited(GpuRequest(1, GIB, 0), "batch", profiles)
    assert request.sharing_limits == () and request.sharing_felt_by == ()
    assert request.sharing_template == "batch"  # its neighbours' reports name it
    held = grant_for(h200().free()[0], request)
    assert held.sharing_template == "batch"
    # a light service's report beside it, naming it as the node agent reads the grant, teaches
    # the pair, and the light service then counts it as measured, not by its weight
    beside = inf.Sample("H100", "light", 2, 290.0, 0.0070, "gpu-0@1", (held.sharing_template,))
    learned = inf.learn([*copies, beside])
    light = learned.get("H100", "light")
    assert light is not None and dict(light.pairs) == {"batch": inf.MAX_DEGREE - 1}
    assert learned.felt_by("batch") == (("H100", (("light", 15.0),)),)
