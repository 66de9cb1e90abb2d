"""The repo's `operator/` folder installs as `carpool.operator`; it must never shadow the
standard library's `operator`, which half the ecosystem imports (json, dataclasses, typing ...).

Python puts the working directory first on sys.path for `python -c`, so from the repo root a
regular package `operator/` (one with `__init__.py`) would win over the standard library. A
folder without `__init__.py` is only a namespace portion, and the standard library's regular
module wins over it; so no top-level folder named like a standard-library module may have one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_operator_is_the_standard_library_module_even_after_carpool_operator() -> None:
    importlib.import_module("carpool.operator")
    import operator

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert operator.__file__ is not None
    assert Path(operator.__file__).resolve().is_relative_to(stdlib)
    assert operator.eq(2, 2) and operator.itemgetter(1)("ab") == "b"
    assert sys.modules["carpool.operator"] is not operator


def test_no_top_level_folder_named_like_the_standard_library_is_a_regular_package() -> None:
    shadowing = [p.name for p in REPO.iterdir()
                 if p.is_dir() and p.name in sys.stdlib_module_names
                 and (p / "__init__.py").exists()]
    assert shadowing == []


def test_import_json_from_the_repo_root() -> None:
    """What the README's tour does: the virtualenv first on PATH, `python3 -c ...` in the repo
    root, nothing else set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    probe = (
        "import json, operator, sysconfig, pathlib, carpool.operator.handlers;"
        "stdlib = pathlib.Path(sysconfig.get_paths()['stdlib']).resolve();"
        "where = pathlib.Path(operator.__file__).resolve();"
        "assert where.is_relative_to(stdlib), where;"
        "print(json.dumps(operator.eq(1, 1)))"
    )
    for python in ("python3", "python"):
        result = subprocess.run([python, "-c", probe], cwd=REPO, env=env,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "true"
