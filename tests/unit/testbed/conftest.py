"""The bench scripts under test, loaded from their files (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load_bench(script: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"carpool_bench_{script}",
                                                  BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_node() -> ModuleType:
    return _load_bench("gpu_node")


@pytest.fixture(scope="module")
def latency_sharing() -> ModuleType:
    return _load_bench("latency_sharing")
