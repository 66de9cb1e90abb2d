"""bench/latency_sharing.py's open-loop server: a service offered requests as a Poisson stream."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "latency_sharing.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carpool_bench_latency_sharing", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_server_that_keeps_up_serves_what_arrives_at_about_its_service_time(
        bench: ModuleType) -> None:
    served, latencies = bench._serve_arrivals(lambda: _busy(0.0005), lambda: None, 0.5,
                                              200.0, "keeps up")
    assert 60 <= len(latencies) <= 140  # about 100 arrivals in half a second
    assert served >= len(latencies) - 5  # at most a few left queued (a busy shared machine)
    assert sorted(latencies)[len(latencies) // 2] < 0.02  # no queue to speak of


def test_a_server_that_cannot_keep_up_shows_its_backlog_in_the_tail(
        bench: ModuleType) -> None:
    # 400 requests/s offered to a server that does 100/s: the queue grows all along
    served, latencies = bench._serve_arrivals(lambda: _busy(0.01), lambda: None, 0.5,
                                              400.0, "falls behind")
    assert served <= 55
    assert len(latencies) > 2 * served  # the requests still queued count too
    assert max(latencies) > 0.2


def test_the_same_seed_gives_the_same_arrivals(bench: ModuleType) -> None:
    runs = [bench._serve_arrivals(lambda: None, lambda: None, 0.2, 300.0, "same")[0]
            for _ in range(2)]
    assert runs[0] == runs[1]
