"""The reference pages under docs/reference/ name everything the code and the chart define:
each CRD field (the pages are generated; a stale page fails), each CARPOOL_* variable the
product reads or sets, each extender and device-plugin flag, each metric and each chart value.
A new setting, flag, metric or value that no page documents fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "docs" / "reference"
PRODUCT = [REPO / "operator", REPO / "extender", REPO / "deviceplugin", REPO / "src" / "carpool"]


def _sources() -> list[Path]:
    return [p for root in PRODUCT for p in sorted(root.rglob("*.py"))
            if "_pb2" not in p.name]


def test_crd_reference_pages_are_current() -> None:
    check = subprocess.run([sys.executable, str(REPO / "hack" / "crd_reference.py"), "--check"],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr


def test_every_carpool_variable_is_in_the_settings_page() -> None:
    page = (REFERENCE / "settings.md").read_text()
    named = {m for p in _sources() for m in re.findall(r"\bCARPOOL_[A-Z_]*[A-Z]\b", p.read_text())}
    assert named, "no CARPOOL_ variables found: the scan is broken"
    missing = sorted(v for v in named if f"`{v}`" not in page)
    assert not missing, f"docs/reference/settings.md does not name {missing}"


@pytest.mark.parametrize("module", ["carpool.extender", "carpool.deviceplugin"])
def test_every_flag_is_in_the_settings_page(module: str) -> None:
    help_text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                               text=True, check=True).stdout
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", help_text)) - {"--help"}
    assert len(flags) > 5, help_text
    page = (REFERENCE / "settings.md").read_text()
    missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", page))
    assert not missing, f"docs/reference/settings.md does not name {module}'s {missing}"


def test_every_metric_is_in_the_metrics_page() -> None:
    defined = re.compile(r"\b(Counter|Gauge|Histogram)\(\s*\"(carpool_[a-z_]+)\"")
    names = set()
    for path in _sources():
        for kind, name in defined.findall(path.read_text()):
            names.add(name + "_total" if kind == "Counter" and not name.endswith("_total")
                      else name)
    assert len(names) > 20, names
    page = (REFERENCE / "metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/reference/metrics.md does not name {missing}"


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) and value else [path]
    return out


def test_every_chart_value_is_in_the_values_page() -> None:
    """A value counts as documented when the page names it or a parent of it below the top
    level (`operator.resources` documents `operator.resources.limits.memory`)."""
    values = yaml.safe_load((REPO / "helm" / "carpool" / "values.yaml").read_text())
    page = (REFERENCE / "chart-values.md").read_text()
    named = set(re.findall(r"`([A-Za-z][\w.]*)`", page))

    def documented(path: str) -> bool:
        parts = path.split(".")
        shortest = min(2, len(parts))
        return any(".".join(parts[:n]) in named for n in range(shortest, len(parts) + 1))

    missing = sorted(p for p in _leaves(values) if not documented(p))
    assert not missing, f"docs/reference/chart-values.md does not name {missing}"
