"""Fixtures for tests that need Carpool itself running on the local cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from carpool_testbed import devcluster, stack, tenants


@pytest.fixture(scope="module")
def carpool_settings() -> dict[str, str]:
    """Settings (environment variables) a module's operator and extender get beyond the
    test defaults; a module that tests a setting overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def carpool_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the module's `operator.log` and `extender.log`, for tests that check what
    a component did beyond what the API server shows (how many passes admitted, say)."""
    return Path(tmp_path_factory.mktemp("carpool-logs"))


@pytest.fixture(scope="module")
def carpool_stack(cluster: devcluster.Cluster, carpool_logs: Path,
                  carpool_settings: dict[str, str]
                  ) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The extender and one operator running against the cluster for one test module.

    Per module, not per session: modules that test a part on its own (the kubectl plugin
    writing statuses, say) must not have an operator rewriting their objects underneath. A
    test that restarts a process puts the new one in its place here, to be stopped at the end.
    """
    env = {"CARPOOL_RESYNC_SECONDS": "2", **carpool_settings}
    with stack.running_stack(cluster, carpool_logs, env) as processes:
        yield processes
        for name in processes:
            if processes[name].poll() is not None:
                print(f"{name} exited early:\n{stack.log_tail(carpool_logs / f'{name}.log')}")


@pytest.fixture
def world(request: pytest.FixtureRequest, cluster: devcluster.Cluster, carpool_stack: object,
          tmp_path: Path) -> Iterator[tenants.World]:
    """One test's namespaces, projects and tenants, served by the module's operator stack, named
    under the module's `WORLD_PREFIX` (a module with a stack of its own defines its own)."""
    with tenants.World(cluster, tmp_path, request.module.WORLD_PREFIX) as made:
        yield made
