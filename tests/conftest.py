"""Shared fixtures. `cluster`: the local cluster (real etcd, API server, controller manager and
kube-scheduler; KWOK nodes), started or reused once per session; see carpool_testbed.devcluster.

Set CARPOOL_KEEP_CLUSTER=1 to keep a cluster this session created; one that was already running
(`make cluster`) is always kept. Missing binaries are built (hack/build-k8s.sh), never skipped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import carpool
import carpool_testbed
from carpool_testbed import devcluster

REPO = Path(__file__).resolve().parents[1]


def modules_not_installed() -> list[str]:
    """Modules of the checkout the editable install does not have: it links each module
    (strict mode), so one added since the last `make dev` is not importable yet."""
    package, testbed = Path(carpool.__file__).parent, Path(carpool_testbed.__file__).parent
    roots = {REPO / "src" / "carpool": package, REPO / "testbed": testbed,
             **{REPO / c: package / c for c in ("operator", "extender", "deviceplugin")}}
    return sorted(str(source.relative_to(REPO))
                  for checkout, installed in roots.items()
                  for source in checkout.rglob("*.py")
                  if "build" not in source.relative_to(checkout).parts
                  and not (installed / source.relative_to(checkout)).is_file())


def pytest_configure(config: pytest.Config) -> None:
    missing = modules_not_installed()
    if missing:
        raise pytest.UsageError(f"not installed yet: {', '.join(missing)}; run `make dev`")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[devcluster.Cluster]:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    keep = os.environ.get("CARPOOL_KEEP_CLUSTER") == "1"
    # Show build and start-up progress live (a cold start builds Kubernetes: minutes).
    with capture.global_and_fixture_disabled():
        session = devcluster.shared_session(keep=keep, progress=devcluster.Progress(sys.stderr))
        handle = session.__enter__()
    try:
        yield handle
    finally:
        with capture.global_and_fixture_disabled():
            session.__exit__(None, None, None)
