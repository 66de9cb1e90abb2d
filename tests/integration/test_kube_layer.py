"""carpool.kube against the real API server: requests with typed errors, a store kept by
list-then-watch (and listing again when asked), and Lease election between two replicas."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from carpool.kube.client import Api
from carpool.kube.errors import Conflict, Invalid, NotFound
from carpool.kube.leases import LeaderElector, LeaseConfig
from carpool.kube.resources import LEASES, NAMESPACES, Resource
from carpool.kube.watching import Store

pytestmark = pytest.mark.cluster
CONFIGMAPS = Resource("", "v1", "configmaps", True)


def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def api(cluster: Any) -> Iterator[Api]:
    with Api.load(cluster.kubeconfig) as api:
        yield api


@pytest.fixture(scope="module")
def namespace(api: Api) -> Iterator[str]:
    name = f"kube-layer-{uuid.uuid4().hex[:6]}"
    api.create(NAMESPACES.path(), {"metadata": {"name": name}})
    yield name
    api.delete(NAMESPACES.path(None, name))


def configmap(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
            "data": data}


def test_requests_answer_dicts_and_refusals_come_as_types(api: Api, namespace: str) -> None:
    created = api.create(CONFIGMAPS.path(namespace), configmap("a", k="1"))
    assert created["data"] == {"k": "1"}
    with pytest.raises(Conflict):
        api.create(CONFIGMAPS.path(namespace), configmap("a"))
    with pytest.raises(Invalid) as refused:
        api.create(CONFIGMAPS.path(namespace), configmap("Not_A_Name"))
    assert "Not_A_Name" in refused.value.message
    with pytest.raises(NotFound):
        api.request("GET", CONFIGMAPS.path(namespace, "missing"))
    assert api.get(CONFIGMAPS.path(namespace, "missing")) is None
    patched = api.patch(CONFIGMAPS.path(namespace, "a"), {"data": {"k": "2"}})
    assert patched["data"] == {"k": "2"}
    assert api.delete(CONFIGMAPS.path(namespace, "missing")) is None


def test_a_store_follows_creates_updates_deletes_and_lists_again(api: Api,
                                                                 namespace: str) -> None:
    changes: list[int] = []
    store = Store(api, CONFIGMAPS, label_selector="store=yes", arrivals=True,
                  keep=lambda obj: {"metadata": obj["metadata"], "data": obj.get("data")},
                  changed=lambda: changes.append(1))
    labelled = {"labels": {"store": "yes"}}
    first = api.create(CONFIGMAPS.path(namespace),
                       {**configmap("s1", v="1"), "metadata": {"name": "s1", **labelled}})
    store.start()
    try:
        assert store.wait_for(int(first["metadata"]["resourceVersion"]), 20)
        assert [o["metadata"]["name"] for o in store.snapshot()] == ["s1"]
        assert store.arrived == 0  # a list is not an arrival
        second = api.create(CONFIGMAPS.path(namespace),
                            {**configmap("s2"), "metadata": {"name": "s2", **labelled}})
        api.create(CONFIGMAPS.path(namespace), configmap("unlabelled"))
        assert store.wait_for(int(second["metadata"]["resourceVersion"]), 20)
        assert store.arrived_since(0) == [store.get(f"{namespace}/s2")]
        updated = api.patch(CONFIGMAPS.path(namespace, "s1"), {"data": {"v": "2"}})
        assert store.wait_for(int(updated["metadata"]["resourceVersion"]), 20)
        assert (store.get(f"{namespace}/s1") or {})["data"] == {"v": "2"}
        api.delete(CONFIGMAPS.path(namespace, "s2"))
        eventually(lambda: store.get(f"{namespace}/s2") is None)
        assert store.get(f"{namespace}/unlabelled") is None
        lists = store.relists
        store.relist()
        eventually(lambda: store.relists == lists + 1)
        third = api.create(CONFIGMAPS.path(namespace),
                           {**configmap("s3"), "metadata": {"name": "s3", **labelled}})
        assert store.wait_for(int(third["metadata"]["resourceVersion"]), 20)
        assert sorted(o["metadata"]["name"] for o in store.snapshot()) == ["s1", "s3"]
        assert changes
    finally:
        store.stop()


def test_one_of_two_replicas_leads_and_a_release_hands_over(api: Api, namespace: str) -> None:
    config = LeaseConfig(name="kube-layer", namespace=namespace, lease_seconds=6,
                         retry_seconds=0.5)
    first, second = LeaderElector(api, config, "first"), LeaderElector(api, config, "second")

    async def scenario() -> None:
        stop_first, stop_second = asyncio.Event(), asyncio.Event()
        run_first = asyncio.create_task(first.run(stop_first))
        deadline = time.monotonic() + 10
        while not first.is_leader():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        run_second = asyncio.create_task(second.run(stop_second))
        await asyncio.sleep(1.5)
        assert first.is_leader() and not second.is_leader()
        stop_first.set()
        await run_first  # releases the lease
        deadline = time.monotonic() + 5  # much less than the 6 s lease: the release did it
        while not second.is_leader():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        lease = api.get(LEASES.path(namespace, "kube-layer")) or {}
        assert lease["spec"]["holderIdentity"] == "second"
        stop_second.set()
        await run_second

    asyncio.run(scenario())
