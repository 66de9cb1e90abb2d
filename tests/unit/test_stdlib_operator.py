"""The repo's `operator/` folder installs as `carpool.operator`; it must never shadow the
standard library's `operator`, which half the ecosystem imports (dataclasses, typing, ...)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def test_operator_is_the_standard_library_module_even_after_carpool_operator() -> None:
    importlib.import_module("carpool.operator")
    import operator

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert operator.__file__ is not None
    assert Path(operator.__file__).resolve().is_relative_to(stdlib)
    assert operator.eq(2, 2) and operator.itemgetter(1)("ab") == "b"
    assert sys.modules["operator"] is operator
    assert sys.modules["carpool.operator"] is not operator


def test_repo_root_is_not_on_sys_path() -> None:
    repo = Path(__file__).resolve().parents[2]
    on_path = {Path(entry or ".").resolve() for entry in sys.path}
    assert repo not in on_path


def test_fresh_interpreter_in_the_repo_root_gets_the_standard_library_operator() -> None:
    """What `make` does: PYTHONSAFEPATH=1 in the repo root, then import both."""
    repo = Path(__file__).resolve().parents[2]
    probe = (
        "import carpool.operator, operator, sysconfig, pathlib;"
        "stdlib = pathlib.Path(sysconfig.get_paths()['stdlib']).resolve();"
        "where = pathlib.Path(operator.__file__).resolve();"
        "assert where.is_relative_to(stdlib), where;"
        "assert operator.eq(1, 1)"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
