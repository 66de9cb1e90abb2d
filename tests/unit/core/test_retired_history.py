"""What deleted jobs leave for the estimates: learned run times and first-estimate misses,
folded in once per job, bounded, kept in the ProjectQuota's status and read back from it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from carpool.core import estimate_ranges, run_times
from carpool.core.accounting import forget_gone, project_usage, retire_deleted
from carpool.core.decoding import retired_from_status, retired_to_status
from carpool.core.jobs import (
    DurationEstimate,
    Job,
    ProjectQuota,
    RetiredUsage,
    RunRecord,
    StartMiss,
)
from carpool.core.resources import GpuRequest, JobClass, Phase
from carpool_testbed.builders import HOUR

QUOTA = ProjectQuota("lab", frozenset({"lab"}), period_s=100 * HOUR)
NOW = 50 * HOUR


def finished(name: str, start: float, seconds: float, *, template: str = "train@img",
             estimate_s: float = 600.0, phase: Phase = Phase.SUCCEEDED, submitted: float = 0.0,
             first_estimate: float | None = None, project: str = "lab") -> Job:
    return Job(f"{project}/{name}", project, JobClass.BATCH, GpuRequest(1, 0), submitted,
               estimate_s, phase=phase, template=template,
               runs=(RunRecord(1, start, start + seconds, 1.0),),
               first_estimated_start=first_estimate)


def retire(*jobs: Job, retired: RetiredUsage | None = None) -> RetiredUsage:
    for job in jobs:
        retired = retire_deleted(retired, job, QUOTA, NOW, 1e12)
    assert retired is not None
    return retired


def round_trip(retired: RetiredUsage, project: str = "lab") -> tuple[RetiredUsage | None,
                                                                      list[str]]:
    """Through JSON, as the API server stores the status and the operator reads it back."""
    return retired_from_status(project, json.loads(json.dumps(
        {"retired": retired_to_status(retired)})))


def test_a_deleted_jobs_run_is_folded_into_its_template_and_class_by_hand() -> None:
    first = retire(finished("train-1", 100, 30))
    one = DurationEstimate(30.0, 0.05, 1, math.log(30), math.log(0.05))
    assert first.learned == {("lab", JobClass.BATCH): one, ("lab", "train@img"): one}
    second = retire(finished("train-2", 200, 60), retired=first)
    estimate = second.learned[("lab", "train@img")]
    # the second run weighs 1/2; each predictor's first error is its plain miss, ln 2
    assert estimate.samples == 2
    assert estimate.seconds == pytest.approx(45.0)
    assert estimate.ratio == pytest.approx(0.075)
    assert estimate.log_seconds == pytest.approx(math.log(math.sqrt(30 * 60)))
    assert (estimate.error_seconds, estimate.error_ratio) == pytest.approx((math.log(2),) * 2)
    assert (estimate.low, estimate.high) == pytest.approx((math.log(2),) * 2)
    # a new job of the template is expected to take the typical run time, not its 10 minutes
    waiting = Job("lab/train-3", "lab", JobClass.BATCH, GpuRequest(1, 0), NOW, 600.0,
                  template="train@img")
    assert run_times.expected_duration(waiting, second.learned) == pytest.approx(math.sqrt(1800))
    # and the same as if both finished jobs were still in the cluster
    in_cluster = run_times.learn_durations([finished("train-1", 100, 30),
                                            finished("train-2", 200, 60)])
    assert second.learned == in_cluster


def test_retiring_twice_folds_once_and_a_new_object_of_the_same_name_counts() -> None:
    job = finished("train-1", 100, 30)
    once = retire(job)
    assert retire_deleted(once, job, QUOTA, NOW, 1e12) is once
    again = retire(Job(**{**job.__dict__, "key": "lab/train-1@other-uid"}), retired=once)
    assert again.learned[("lab", "train@img")].samples == 2


def test_only_succeeded_runs_teach_run_times_but_every_started_job_its_miss() -> None:
    failed = finished("train-1", 300, 5, phase=Phase.FAILED, first_estimate=100.0)
    retired = retire(failed)
    assert retired.learned == {}
    # promised 100 s, started after 300 s
    ((record),) = retired.start_misses
    assert (record.start, record.job_class, record.simulated) == (300.0, JobClass.BATCH, None)
    assert record.shown == pytest.approx(math.log(3))
    # a first estimate under a minute says little of the error and is not kept
    assert retire(finished("quick", 50, 5, first_estimate=30.0)).start_misses == ()


def test_learned_templates_are_capped_keeping_the_most_recently_updated() -> None:
    cap = estimate_ranges.MAX_RETIRED_TEMPLATES
    jobs = [finished(f"t{i}-job", 10.0 * i, 5, template=f"t{i}") for i in range(cap + 5)]
    retired = retire(*jobs)
    templates = [k for _, k in retired.learned if isinstance(k, str)]
    assert templates == [f"t{i}" for i in range(5, cap + 5)]
    assert retired.learned[("lab", JobClass.BATCH)].samples == cap + 5  # classes are kept
    # running t5 again makes it the newest: t6 goes next
    retired = retire(finished("t5-again", 9999, 5, template="t5"),
                     finished("new-job", 10000, 5, template="new"), retired=retired)
    templates = [k for _, k in retired.learned if isinstance(k, str)]
    assert templates[-2:] == ["t5", "new"] and "t6" not in templates and len(templates) == cap
    # and the order survives the status
    read_back, problems = round_trip(retired)
    assert read_back is not None and not problems
    assert list(read_back.learned) == list(retired.learned)


def test_misses_are_kept_by_start_time_the_last_hundred() -> None:
    # retired in another order than they started
    jobs = [finished(f"j{i}", 1000.0 + (i * 37) % 150, 5, first_estimate=100.0)
            for i in range(150)]
    retired = retire(*jobs)
    assert len(retired.start_misses) == estimate_ranges.RECENT_MISSES
    starts = [miss.start for miss in retired.start_misses]
    assert starts == sorted(starts) and starts[0] == 1050.0


def test_the_status_round_trip_keeps_everything_exactly() -> None:
    retired = retire(finished("train-1", 100, 30, first_estimate=100.0),
                     finished("train-2", 200, 61.3, first_estimate=90.0),
                     finished("other-1", 300, 7, template="other"))
    read_back, problems = round_trip(retired)
    assert not problems and read_back is not None
    assert read_back.learned == retired.learned
    assert read_back.start_misses == retired.start_misses
    assert read_back.job_keys == retired.job_keys
    status = retired_to_status(retired)
    # least recently updated first: other-1 updated the class, then its template
    assert [e.get("template") for e in status["learned"]] == ["train@img", None, "other"]
    assert status["learned"][1] == {"class": "batch", **{
        name: getattr(retired.learned[("lab", JobClass.BATCH)], field)
        for field, name in (("samples", "samples"), ("seconds", "seconds"), ("ratio", "ratio"),
                            ("log_seconds", "logSeconds"), ("log_ratio", "logRatio"),
                            ("error_seconds", "errorSeconds"), ("error_ratio", "errorRatio"),
                            ("low", "low"), ("high", "high"))}}
    assert status["startMisses"][0] == {"start": "1970-01-01T00:01:40Z", "class": "batch",
                                        "shown": retired.start_misses[0].shown}


def test_an_older_status_without_history_reads_as_none_learned() -> None:
    status = {"retired": {"periodStart": "2026-01-01T00:00:00Z", "gpuHours": 1.5,
                          "decayedGpuHours": 1.0, "decayedAsOf": "2026-01-02T00:00:00Z",
                          "jobs": ["a/b@u"]}}
    retired, problems = retired_from_status("lab", status)
    assert not problems and retired is not None
    assert (retired.gpu_hours, retired.learned, retired.start_misses) == (1.5, {}, ())
    assert retired_from_status("lab", {}) == (None, [])


GOOD: dict[str, Any] = {"template": "train@img", "samples": 2, "seconds": 45.0,
                        "ratio": 0.075, "logSeconds": 3.7, "logRatio": -2.6,
                        "errorSeconds": 0.69, "errorRatio": 0.69, "low": 0.69, "high": 0.69}


@pytest.mark.parametrize(("entry", "says"), [
    ("train", "not an object"),
    ({**GOOD, "class": "batch"}, "exactly one of class and template"),
    ({k: v for k, v in GOOD.items() if k != "template"}, "exactly one of class and template"),
    ({**GOOD, "template": ""}, "not a non-empty string"),
    ({**{k: v for k, v in GOOD.items() if k != "template"}, "class": "urgent"},
     "unknown class 'urgent'"),
    ({**GOOD, "samples": 0}, "not a positive integer"),
    ({**GOOD, "samples": 1.5}, "not a positive integer"),
    ({**GOOD, "seconds": -1.0}, "must be positive"),
    ({**GOOD, "ratio": "0.5"}, "ratio '0.5' is not a number"),
    ({**GOOD, "low": True}, "low True is not a number"),
    ({k: v for k, v in GOOD.items() if k != "high"}, "high None is not a number"),
])
def test_a_malformed_learned_entry_is_left_out_and_named(entry: object, says: str) -> None:
    other = {**GOOD, "template": "other"}
    retired, problems = retired_from_status("lab", {"retired": {"learned": [entry, other]}})
    assert retired is not None and list(retired.learned) == [("lab", "other")]
    assert len(problems) == 1
    assert problems[0].startswith("status.retired.learned[0]: ") and says in problems[0]


def test_malformed_fields_are_ignored_with_a_problem_each_not_raised() -> None:
    status = {"retired": {"periodStart": "yesterday", "gpuHours": "lots",
                          "decayedGpuHours": float("nan"), "jobs": "a/b",
                          "learned": {"train": 1},
                          "startMisses": [{"start": "2026-01-01T00:00:00Z", "class": "long",
                                           "shown": 0.5},
                                          {"start": "soon", "class": "long", "shown": 0.1},
                                          [1, 2],
                                          {"start": "2026-01-01T00:00:00Z", "class": "long"},
                                          {"start": "2026-01-01T00:00:00Z", "shown": 0.1},
                                          {"start": "2026-01-01T00:00:00Z", "class": "long",
                                           "shown": 0.1, "simulated": "far"}]}}
    retired, problems = retired_from_status("lab", status)
    assert retired is not None
    assert (retired.period_start, retired.gpu_hours, retired.decayed_gpu_hours) == (0, 0, 0)
    assert retired.job_keys == frozenset() and retired.learned == {}
    assert retired.start_misses == (StartMiss(1767225600.0, JobClass.LONG, 0.5, None),)
    fields = sorted(p.split(":")[0] for p in problems)
    assert fields == sorted(["status.retired.periodStart", "status.retired.gpuHours",
                      "status.retired.decayedGpuHours", "status.retired.jobs",
                      "status.retired.learned", "status.retired.startMisses[1]",
                      "status.retired.startMisses[2]", "status.retired.startMisses[3]",
                      "status.retired.startMisses[4]", "status.retired.startMisses[5]"])
    assert retired_from_status("lab", {"retired": ["x"]}) == (
        None, ["status.retired: not an object; ignored"])


def test_kept_history_merges_projects_and_keeps_the_last_misses_by_start() -> None:
    a = retire(*(finished(f"a{i}", 2.0 * i, 5, first_estimate=100.0) for i in range(80)))
    b = retire(*(finished(f"b{i}", 2.0 * i + 1, 5, first_estimate=100.0, project="other")
                 for i in range(80)))
    learned, misses = estimate_ranges.kept_history([a, b])
    assert set(learned) == {("lab", JobClass.BATCH), ("lab", "train@img"),
                            ("other", JobClass.BATCH), ("other", "train@img")}
    # the last 100 of 160 misses by start time, oldest first: starts 60..159
    assert [m.start for m in misses] == list(range(60, 160))
    assert [m.shown for m in misses] == pytest.approx(
        [math.log(start / 100) for start in range(60, 160)])
    assert estimate_ranges.kept_history([]) == ({}, ())


def test_a_new_budget_period_keeps_the_history() -> None:
    quota = ProjectQuota("lab", frozenset({"lab"}), period_s=HOUR)
    retired = retire_deleted(None, finished("train-1", 100, 30), quota, 0.5 * HOUR, 1e12)
    later = retire_deleted(retired, finished("train-2", 200, 60), quota, 2.5 * HOUR, 1e12)
    assert later.period_start == 2 * HOUR and later.job_keys == {"lab/train-1", "lab/train-2"}
    assert later.learned[("lab", "train@img")].samples == 2


def test_a_job_retired_again_after_the_period_rolled_over_counts_once() -> None:
    # train-1 was folded in but its finalizer not yet removed when the period rolled over;
    # train-2 is retired in the new period, then train-1's deletion is handled again
    quota = ProjectQuota("lab", frozenset({"lab"}), period_s=HOUR)
    first, second = finished("train-1", 100, 30), finished("train-2", 200, 60)
    retired = retire_deleted(None, first, quota, 0.5 * HOUR, 1e12)
    later = retire_deleted(retired, second, quota, 1.5 * HOUR, 1e12)
    again = retire_deleted(later, first, quota, 1.6 * HOUR, 1e12)
    assert again is later
    assert later.learned[("lab", "train@img")].samples == 2
    alone = retire_deleted(None, second, quota, 1.5 * HOUR, 1e12)
    assert project_usage(quota, [first], 1.6 * HOUR, 1e12, again).decayed_gpu_hours == (
        pytest.approx(retired.decayed_gpu_hours + alone.decayed_gpu_hours))


def test_keys_of_jobs_that_are_gone_are_forgotten_and_nothing_else() -> None:
    retired = retire(finished("train-1", 100, 30), finished("train-2", 200, 60))
    assert retired.job_keys == {"lab/train-1", "lab/train-2"}
    assert forget_gone(retired, {"lab/train-1", "lab/other"}) == RetiredUsage(
        retired.period_start, retired.gpu_hours, retired.decayed_gpu_hours,
        retired.decayed_as_of, frozenset({"lab/train-1"}), retired.learned,
        retired.start_misses)
    assert forget_gone(retired, {"lab/train-1", "lab/train-2"}) is retired


def test_simulated_misses_are_kept_per_class_the_last_fifty_and_read_back() -> None:
    def simulated(name: str, start: float, cls: JobClass) -> Job:
        job = finished(name, start, 10, first_estimate=start / 2)
        return Job(job.key, job.project, cls, job.request, 0.0, job.estimated_duration_s,
                   phase=job.phase, template=job.template, runs=job.runs,
                   first_simulated_start=start / 2)  # every start twice as late as simulated

    longs = [simulated(f"l-{i}", 1000.0 + i, JobClass.LONG)
             for i in range(estimate_ranges.CLASS_MISSES + 3)]
    retired = retire(*longs, simulated("b-1", 5000.0, JobClass.BATCH))
    _, kept = estimate_ranges.kept_history([retired])
    long_starts = [m.start for m in kept if m.job_class is JobClass.LONG]
    # simulated misses only: of the long jobs, the last 50 are kept
    assert long_starts == [1003.0 + i for i in range(estimate_ranges.CLASS_MISSES)]
    by_class = estimate_ranges.class_misses(kept)
    assert by_class[JobClass.LONG] == [pytest.approx(math.log(2))] * estimate_ranges.CLASS_MISSES
    assert by_class[JobClass.BATCH] == [pytest.approx(math.log(2))]
    back, problems = round_trip(retired)
    assert problems == [] and back is not None
    assert back.start_misses == retired.start_misses
    # a hand-edited entry naming no class is left out and named
    status = {"retired": {**retired_to_status(retired),
                          "startMisses": [{"class": "urgent", "start": "2026-12-01T10:00:00Z",
                                           "simulated": 0.5}]}}
    edited, problems = retired_from_status("lab", status)
    assert edited is not None and edited.start_misses == ()
    assert problems and "startMisses[0]" in problems[0] and "urgent" in problems[0]


def test_a_miss_is_kept_while_either_of_its_parts_can_count() -> None:
    # 100 batch jobs shown an estimate, none simulated, start after one long job that was
    # simulated only: its shown miss no longer counts, its simulated one does
    long_job = StartMiss(1.0, JobClass.LONG, None, 0.7)
    shown = [StartMiss(10.0 + i, JobClass.BATCH, 0.1, None)
             for i in range(estimate_ranges.RECENT_MISSES)]
    older_shown = StartMiss(2.0, JobClass.BATCH, 0.9, None)
    kept = estimate_ranges.recent_misses([*shown, older_shown, long_job])
    assert kept == (long_job, *shown)
