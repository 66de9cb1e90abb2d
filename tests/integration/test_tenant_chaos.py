"""The tenant chaos run, short (`make test`): two projects' GpuJobs on simulated GPU nodes with
the real operator, strict extender and kube-scheduler under the chart's admission policies,
while a tenant with `edit` in one project's namespace attacks for
`$CARPOOL_TENANT_CHAOS_SECONDS` (default 45) through the API server with impersonation.
carpool_testbed.tenantchaos says what it tries and checks; e2e/test_tenant_chaos.py is the
10-minute run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carpool_testbed import devcluster, tenantchaos

pytestmark = pytest.mark.cluster

SECONDS = float(os.environ.get("CARPOOL_TENANT_CHAOS_SECONDS", "45"))


def test_a_tenant_attacking_for_a_while_changes_nothing_of_the_other_project(
        cluster: devcluster.Cluster, tmp_path: Path) -> None:
    settings = tenantchaos.Settings(duration_s=SECONDS, nodes=2, victim_live=6, tenant_live=4,
                                    victim_gpus=5, tenant_gpus=3, run_s=(5, 15),
                                    progress_s=10, settle_s=60)
    report = tenantchaos.run(cluster, settings, tmp_path)
    tried, _, refused = report.tally.totals()
    assert tried >= SECONDS, "the tenant hardly attacked"  # about 3 a second
    assert refused > 0 and report.victim_jobs >= 6, report.table()
    assert report.passed(), report.table() + "\n" + "\n".join(report.violations[:30])
