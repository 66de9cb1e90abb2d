"""bench/latency_sharing.py's open-loop server: a service offered requests as a Poisson stream."""

from __future__ import annotations

import time
from types import ModuleType


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_server_that_keeps_up_serves_what_arrives_at_about_its_service_time(
        latency_sharing: ModuleType) -> None:
    served, latencies = latency_sharing._serve_arrivals(lambda: _busy(0.0005), lambda: None, 0.5,
                                              200.0, "keeps up")
    assert 60 <= len(latencies) <= 140  # about 100 arrivals in half a second
    assert served >= len(latencies) - 5  # at most a few left queued (a busy shared machine)
    assert sorted(latencies)[len(latencies) // 2] < 0.02  # no queue to speak of


def test_a_server_that_cannot_keep_up_shows_its_backlog_in_the_tail(
        latency_sharing: ModuleType) -> None:
    # 400 requests/s offered to a server that does 100/s: the queue grows all along
    served, latencies = latency_sharing._serve_arrivals(lambda: _busy(0.01), lambda: None, 0.5,
                                              400.0, "falls behind")
    assert served <= 55
    assert len(latencies) > 2 * served  # the requests still queued count too
    assert max(latencies) > 0.2


def test_the_same_seed_gives_the_same_arrivals(latency_sharing: ModuleType) -> None:
    # every arrival is served or counted as queued, however busy the machine
    runs = [len(latency_sharing._serve_arrivals(lambda: None, lambda: None, 0.2, 300.0, "same")[1])
            for _ in range(2)]
    assert runs[0] == runs[1] > 0


def test_judging_a_past_run_counts_what_each_rule_accepts_and_what_broke(
        latency_sharing: ModuleType) -> None:
    profile = [{"template": t, "degree": d, "req_per_s": rate, "p99_ms": p99,
                "company": f"profile {t} x{d} #0", "neighbours": [t] * (d - 1)}
               for t, curve in (("light", {1: (300, 2.7), 2: (290, 3.0), 3: (283, 3.5)}),
                                ("heavy", {1: (106, 9.8), 2: (107, 15.0), 3: (108, 30.0)}))
               for d, (rate, p99) in curve.items()]
    services = [{"name": "l1", "template": "light", "p99_target_ms": 5.35},
                {"name": "l2", "template": "light", "p99_target_ms": 5.35},
                {"name": "h1", "template": "heavy", "p99_target_ms": 49.0}]
    # learning put a light and a heavy service together: the light one waited 7 ms
    learning = [[{"l1": {"req_per_s": 290, "p99_ms": 7.0, "weight": 340},
                  "h1": {"req_per_s": 106, "p99_ms": 11.0, "weight": 327}}]]
    policies = {"fixed 2": {"groups": [["l1", "h1"], ["l2"]],
                            "p99_vs_target": {"l1": 1.4, "h1": 0.2, "l2": 0.5}},
                "fixed 3": {"groups": [["l1", "l2"], ["h1"]],
                            "p99_vs_target": {"l1": 0.6, "l2": 0.6, "h1": 0.2}}}
    judged = latency_sharing.judge({"model": "H100", "profile": profile, "services": services,
                          "learning": learning, "policies": policies})
    # with pairs the light service refuses the heavy one's company, where it broke, and takes
    # a copy of itself, where it kept its target; by weight only the report beside the heavy
    # one lifted its own curve, and it refuses the copy too
    assert judged["pairs"] == {"accepted, kept": 5, "accepted, broke": 0,
                               "refused, kept": 0, "refused, broke": 1}
    assert judged["by weight only"] == {"accepted, kept": 3, "accepted, broke": 0,
                                        "refused, kept": 2, "refused, broke": 1}


def test_judging_learns_the_pairs_the_profiling_run_measured(
        latency_sharing: ModuleType) -> None:
    """A pair measured by the profiling run (no learning placement ever put the two
    together) teaches the judged rule as it taught the run's own."""
    curves = (("light", {1: (300, 2.7), 2: (290, 3.0), 3: (283, 3.5)}),
              ("heavy", {1: (106, 9.8), 2: (107, 15.0), 3: (108, 30.0)}))
    profile = [{"template": t, "degree": d, "req_per_s": rate, "p99_ms": p99,
                "company": f"profile {t} x{d} #0", "neighbours": [t] * (d - 1)}
               for t, curve in curves for d, (rate, p99) in curve.items()]
    profile += [{"template": "light", "degree": 2, "req_per_s": 290, "p99_ms": 7.0,
                 "company": "pair light+heavy", "neighbours": ["heavy"]},
                {"template": "heavy", "degree": 2, "req_per_s": 106, "p99_ms": 11.0,
                 "company": "pair light+heavy", "neighbours": ["light"]}]
    services = [{"name": "l1", "template": "light", "p99_target_ms": 5.35},
                {"name": "h1", "template": "heavy", "p99_target_ms": 49.0}]
    policies = {"fixed 2": {"groups": [["l1", "h1"]],
                            "p99_vs_target": {"l1": 1.4, "h1": 0.2}}}
    judged = latency_sharing.judge({"model": "H100", "profile": profile, "services": services,
                                    "learning": [], "policies": policies})
    assert judged["pairs"] == {"accepted, kept": 1, "accepted, broke": 0,
                               "refused, kept": 0, "refused, broke": 1}
