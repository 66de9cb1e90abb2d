"""The GpuJob CRD's CEL rules: spec rules run on create only (see crds/gpujob.yaml).

The API server evaluates every rule of an object on every write, status writes included; the
spec is immutable, so a spec rule other than the immutability rule is guarded to skip when an
old value exists. A rule added later without the guard would put its cost back on every
status write of every job; this catches it.
"""

from __future__ import annotations

from typing import Any

from carpool.core.names import GPUJOB_PLURAL
from carpool_testbed import crds


def _rules(node: Any, path: str = "spec") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found += [(path, rule) for rule in node.get("x-kubernetes-validations", [])]
        for key, child in (node.get("properties") or {}).items():
            found += _rules(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            found += _rules(node["items"], f"{path}[]")
    return found


def test_spec_rules_other_than_immutability_are_create_only() -> None:
    spec = crds.crd_schema(GPUJOB_PLURAL)["properties"]["spec"]
    rules = _rules(spec)
    assert [(p, r["rule"]) for p, r in rules if "oldSelf" in r["rule"]
            and not r.get("optionalOldSelf")] == [("spec", "self == oldSelf")]
    unguarded = [(p, r["rule"]) for p, r in rules if r["rule"] != "self == oldSelf"
                 and not (r.get("optionalOldSelf")
                          and r["rule"].startswith("oldSelf.hasValue() || ("))]
    assert not unguarded
    assert len(rules) == 29  # 10 of them on what a template may not decide, 6 on gangs
