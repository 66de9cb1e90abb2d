"""Shared fixtures. `cluster`: the local cluster (real etcd, API server, controller manager and
kube-scheduler; KWOK nodes), started or reused once per session; see carpool_testbed.devcluster.

Set CARPOOL_KEEP_CLUSTER=1 to keep a cluster this session created; one that was already running
(`make cluster`) is always kept. Missing binaries are built (hack/build-k8s.sh), never skipped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from carpool_testbed import devcluster


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
