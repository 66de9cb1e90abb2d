"""hack/images/build.py is a script, not a module of the package: load it once for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def image_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carpool_image_build",
                                                  REPO / "hack" / "images" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
