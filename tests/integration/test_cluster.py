"""The local cluster is the real thing: the API server stores what we create, the real
kube-scheduler binds pods (both profiles), KWOK plays kubelet, and the scheduler is configured
to call the Carpool extender."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client  # type: ignore[import-untyped]
from kubernetes.client.rest import ApiException  # type: ignore[import-untyped]

from carpool.core import names
from carpool_testbed import devcluster

pytestmark = pytest.mark.cluster

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """Polls `probe` until it returns something truthy; fails naming `what` otherwise.

    Timeouts are generous: on a shared 2-core machine a benchmark can starve the kwok
    controller for tens of seconds; the assertions, not the timing, are the test.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def core(cluster: devcluster.Cluster) -> Iterator[Any]:
    api = cluster.api()
    yield client.CoreV1Api(api)
    api.close()


@pytest.fixture(scope="module")
def namespace(core: Any) -> Iterator[str]:
    name = f"devcluster-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def node(core: Any) -> Iterator[str]:
    """One simulated node; kwok marks it Ready."""
    name = f"kwok-devcluster-{uuid.uuid4().hex[:6]}"
    core.create_node(devcluster.kwok_node(name, {"cpu": "8", "memory": "32Gi", "pods": "110"}))

    def ready() -> bool:
        conditions = core.read_node(name).status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    try:
        eventually(ready, 120, f"node {name} to become Ready")
        yield name
    finally:
        core.delete_node(name)


def pod_manifest(
    name: str, node: str, scheduler: str = "default-scheduler", **annotations: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "schedulerName": scheduler,
            # Picks the node through the scheduler's own filters, not spec.nodeName.
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [devcluster.KWOK_TOLERATION],
            "containers": [{"name": "main", "image": "registry.invalid/carpool/sim:1"}],
        },
    }


def phase(core: Any, namespace: str, name: str) -> str:
    return str(core.read_namespaced_pod(name, namespace).status.phase)


@pytest.mark.parametrize("scheduler", ["default-scheduler", names.SCHEDULER_NAME])
def test_the_scheduler_binds_a_plain_pod_and_kwok_runs_it(
    core: Any, namespace: str, node: str, scheduler: str
) -> None:
    name = f"plain-{scheduler}"
    core.create_namespaced_pod(namespace, pod_manifest(name, node, scheduler))

    running = eventually(
        lambda: (p := core.read_namespaced_pod(name, namespace)).status.phase == "Running" and p,
        120,
        f"{name} to run",
    )
    assert running.spec.node_name == node
    conditions = {c.type: c.status for c in running.status.conditions}
    assert conditions["PodScheduled"] == "True" and conditions["Ready"] == "True"
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason=Scheduled"
    ).items
    # The Scheduled event is written by the scheduler profile that bound the pod.
    assert [e.reporting_component or e.source.component for e in events] == [scheduler]


def test_simulated_duration_completes_the_pod_and_others_keep_running(
    core: Any, namespace: str, node: str
) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("forever", node))
    core.create_namespaced_pod(
        namespace, pod_manifest("two-seconds", node, **{names.ANN_SIM_DURATION: "2"})
    )

    done = eventually(
        lambda: (
            (p := core.read_namespaced_pod("two-seconds", namespace)).status.phase == "Succeeded"
            and p
        ),
        120,
        "two-seconds to succeed",
    )
    (container,) = done.status.container_statuses
    terminated = container.state.terminated
    assert terminated.exit_code == 0 and terminated.reason == "Completed"
    ran_for = (terminated.finished_at - done.status.start_time).total_seconds()
    assert 1 <= ran_for <= 60, ran_for  # timestamps have whole seconds
    assert phase(core, namespace, "forever") == "Running"


def test_a_pod_deleted_with_a_grace_period_goes_away(core: Any, namespace: str, node: str) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("doomed", node))
    eventually(lambda: phase(core, namespace, "doomed") == "Running", 120, "doomed to run")

    core.delete_namespaced_pod("doomed", namespace, grace_period_seconds=30)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("doomed", namespace)
        except ApiException as error:
            return bool(error.status == 404)
        return False

    eventually(gone, 60, "doomed to be removed")


def test_the_running_scheduler_is_configured_with_the_carpool_extender(
    cluster: devcluster.Cluster,
) -> None:
    config = yaml.safe_load(Path(cluster.workdir / "scheduler.yaml").read_text())
    assert [p["schedulerName"] for p in config["profiles"]] == [
        "default-scheduler",
        names.SCHEDULER_NAME,
    ]
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == f"http://127.0.0.1:{cluster.extender_port}/"
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    assert extender["httpTimeout"] == "10s" and extender["weight"] == 5
    assert {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]} == {
        names.RESOURCE_GPU: True,
        names.RESOURCE_GPU_MEMORY: True,
        names.RESOURCE_GPU_CORES: True,
    }
    # ...and that file is what the live kube-scheduler process was started with.
    pid = int((cluster.workdir / "pids" / "kube-scheduler.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert f"--config={cluster.workdir / 'scheduler.yaml'}" in argv
