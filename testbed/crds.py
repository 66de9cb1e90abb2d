"""The Carpool CRDs: loading them from `crds/` and applying them to a cluster.

`crds/` at the repository root is the single source of truth; the test bed always runs from a
checkout and reads it in place, so an edited CRD takes effect without a reinstall.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from carpool.core.names import GPUJOB_PLURAL, GPUNODE_PLURAL, GROUP, PROJECTQUOTA_PLURAL

CRD_FILES = ("gpujob.yaml", "projectquota.yaml", "gpunode.yaml")
CRD_NAMES = tuple(f"{plural}.{GROUP}" for plural in (GPUJOB_PLURAL, PROJECTQUOTA_PLURAL,
                                                      GPUNODE_PLURAL))
FIELD_MANAGER = "carpool-crds"


def crd_directory() -> Traversable:
    """The checkout's `crds/` (the editable install links this file back into the checkout)."""
    return Path(__file__).resolve().parents[1] / "crds"


def load_crds(directory: Traversable | None = None) -> list[dict[str, Any]]:
    """The three CustomResourceDefinition manifests as dicts, in CRD_FILES order."""
    base = directory if directory is not None else crd_directory()
    manifests: list[dict[str, Any]] = []
    for name in CRD_FILES:
        manifest = yaml.safe_load((base / name).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("kind") != "CustomResourceDefinition":
            raise ValueError(f"{name}: not a CustomResourceDefinition manifest")
        manifests.append(manifest)
    return manifests


def crd_schema(plural: str) -> dict[str, Any]:
    """The v1alpha1 openAPIV3Schema of one CRD, e.g. for offline checks in tests."""
    for manifest in load_crds():
        if manifest["spec"]["names"]["plural"] == plural:
            schema: dict[str, Any] = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"no Carpool CRD with plural {plural!r}")


def _established(crd: dict[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def apply_crds(
    api_client: Any,
    manifests: Iterable[dict[str, Any]] | None = None,
    *,
    timeout_s: float = 60.0,
) -> list[str]:
    """Server-side apply the CRDs and wait until the API server serves them (`api_client`: a
    `carpool.kube.client.Api`, or a kubernetes `ApiClient`).

    Returns the CRD names. Raises TimeoutError naming the CRDs that never became Established
    (e.g. a rejected schema leaves NamesAccepted or NonStructuralSchema conditions behind).
    """
    from carpool.kube.client import Api  # the adapter side: only this function talks to a cluster
    from carpool.kube.resources import CRDS

    api = Api.of(api_client)
    names: list[str] = []
    for manifest in manifests if manifests is not None else load_crds():
        name = manifest["metadata"]["name"]
        api.apply(CRDS.path(None, name), manifest, FIELD_MANAGER)
        names.append(name)
    deadline = time.monotonic() + timeout_s
    waiting = set(names)
    while waiting:
        waiting = {n for n in waiting if not _established(api.get(CRDS.path(None, n)))}
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRDs not Established after {timeout_s:.0f}s: {sorted(waiting)}")
        time.sleep(0.2)
    return names
