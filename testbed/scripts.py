"""Bench scripts loaded as modules from their files.

bench/ is not a package, and a bench run with PYTHONSAFEPATH=1 (so that the repo's operator/
does not shadow the standard library) has no script directory on sys.path: a script that
uses another's code (the peers round uses bench/admission.py's jobs) loads it by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """The script at `path` as a module, loaded once per process (registered in sys.modules
    before it runs: its dataclasses look their module up there)."""
    name = f"carpool_bench_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
