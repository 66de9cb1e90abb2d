"""The tenant chaos run, long (`make e2e`): two projects' GpuJobs under load on simulated GPU
nodes with the real operator, strict extender and kube-scheduler under the chart's admission
policies, while a tenant with `edit` in one project's namespace attacks through the API server
with impersonation for `$CARPOOL_TENANT_CHAOS_MINUTES` (default 10). carpool_testbed.tenantchaos
says what it tries and checks; the printed table and `$CARPOOL_TENANT_CHAOS_REPORT` (default
build/tenant-chaos.json) feed docs/reliability.md. `$CARPOOL_TENANT_CHAOS_WITHOUT_POLICIES`
(comma-separated, e.g. carpool-pod-metadata) leaves chart policies out, to try the components
behind them.

Runs on a cluster of its own (`$CARPOOL_TENANT_CHAOS_CLUSTER`, default carpool-tenant-chaos; its
scheduler calls the extender on `$CARPOOL_TENANT_CHAOS_EXTENDER_PORT`, default 18196), since the
chart's policies it applies are cluster-wide. The same run without pytest:
`carpool-testbed tenant-chaos --minutes 10`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from carpool_testbed import devcluster, tenantchaos

REPO = Path(__file__).resolve().parents[1]
MINUTES = float(os.environ.get("CARPOOL_TENANT_CHAOS_MINUTES", "10"))
# chart policies to leave out, comma-separated (e.g. carpool-pod-metadata): the components
# behind them must then ignore what gets through
WITHOUT = tuple(p for p in os.environ.get("CARPOOL_TENANT_CHAOS_WITHOUT_POLICIES", "").split(",")
                if p)
REPORT = Path(os.environ.get("CARPOOL_TENANT_CHAOS_REPORT", str(REPO / "build" /
                                                                "tenant-chaos.json")))


@pytest.fixture(scope="module")
def chaos_cluster() -> Iterator[devcluster.Cluster]:
    name = os.environ.get("CARPOOL_TENANT_CHAOS_CLUSTER", "carpool-tenant-chaos")
    port = os.environ.get("CARPOOL_TENANT_CHAOS_EXTENDER_PORT", "18196")
    saved = os.environ.get(devcluster.EXTENDER_PORT_ENV)
    os.environ[devcluster.EXTENDER_PORT_ENV] = port
    try:
        session = devcluster.shared_session(
            name, keep=os.environ.get("CARPOOL_KEEP_CLUSTER") == "1",
            progress=devcluster.Progress(sys.stderr))
        cluster = session.__enter__()
    finally:
        if saved is None:
            os.environ.pop(devcluster.EXTENDER_PORT_ENV, None)
        else:
            os.environ[devcluster.EXTENDER_PORT_ENV] = saved
    try:
        yield cluster
    finally:
        session.__exit__(None, None, None)


@pytest.mark.timeout(MINUTES * 60 + 900)
def test_a_tenant_attacking_for_minutes_changes_nothing_of_the_other_project(
        chaos_cluster: devcluster.Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    settings = tenantchaos.Settings(duration_s=MINUTES * 60, without_policies=WITHOUT)
    report = tenantchaos.run(chaos_cluster, settings, tmp_path_factory.mktemp("tenant-chaos"))
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report.as_json(), indent=2))
    tried, _, refused = report.tally.totals()
    assert tried >= settings.duration_s and refused > 0, report.table()
    assert report.victim_jobs >= 30, report.table()
    assert report.passed(), report.table() + "\n" + "\n".join(report.violations[:50])
