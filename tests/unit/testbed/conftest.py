"""The bench scripts under test, loaded from their files (bench/ is not a package)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from carpool_testbed.scripts import load_script

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load_bench(script: str) -> ModuleType:
    return load_script(BENCH / f"{script}.py")


@pytest.fixture(scope="module")
def gpu_node() -> ModuleType:
    return _load_bench("gpu_node")


@pytest.fixture(scope="module")
def latency_sharing() -> ModuleType:
    return _load_bench("latency_sharing")
