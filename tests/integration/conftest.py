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
def carpool_extender_args() -> tuple[str, ...]:
    """Arguments a module's extender gets beyond the test bed's; a module that tests an
    extender flag (`--lending`, say) overrides this fixture."""
    return ()


@pytest.fixture(scope="module")
def carpool_metrics_port() -> int:
    """The port of the module's operator's /metrics (served, as the chart's operator serves
    it), for tests that read what the operator counted."""
    return stack.free_port()


@pytest.fixture(scope="module")
def carpool_operator_env(carpool_metrics_port: int, carpool_settings: dict[str, str]
                         ) -> dict[str, str]:
    """The environment the module's operator starts with, also when a test starts it again:
    a pass every 2 s, metrics on `carpool_metrics_port`, then the module's settings."""
    return {"CARPOOL_RESYNC_SECONDS": "2", "CARPOOL_METRICS_PORT": str(carpool_metrics_port),
            **carpool_settings}


@pytest.fixture(scope="module")
def carpool_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the module's `operator.log` and `extender.log`, for tests that check what
    a component did beyond what the API server shows (how many passes admitted, say)."""
    return Path(tmp_path_factory.mktemp("carpool-logs"))


@pytest.fixture(scope="module")
def carpool_stack(cluster: devcluster.Cluster, carpool_logs: Path,
                  carpool_operator_env: dict[str, str], carpool_extender_args: tuple[str, ...]
                  ) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The extender and one operator running against the cluster for one test module.

    Per module, not per session: modules that test a part on its own (the kubectl plugin
    writing statuses, say) must not have an operator rewriting their objects underneath. A
    test that restarts the operator starts it with `carpool_operator_env`, logging to
    `carpool_logs`, and puts it in its place here, to be stopped at the end.
    """
    with stack.running_stack(cluster, carpool_logs, carpool_operator_env,
                             extender_args=carpool_extender_args) as processes:
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
