"""The asynchronous Binding write against a stand-in API server (aiohttp)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from carpool.extender.kube import KubeCluster
from carpool.extender.service import ClusterError
from carpool.kube.client import Api


def run_against(status: int, reply: dict[str, Any], call: Any) -> list[dict[str, Any]]:
    """Serve POST .../binding with `status`/`reply`; run `call(cluster)`; the requests seen."""
    seen: list[dict[str, Any]] = []

    async def binding(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers.get("Authorization"),
                     "body": await request.json()})
        return web.json_response(reply, status=status)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/binding", binding)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
        configuration.api_key = {"authorization": "tok"}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        cluster = KubeCluster(Api(configuration))
        try:
            await call(cluster)
        finally:
            await cluster.close()
            await runner.cleanup()

    asyncio.run(main())
    return seen


def test_the_binding_carries_node_preconditions_and_annotations() -> None:
    async def bind(cluster: KubeCluster) -> None:
        await cluster.bind_pod_async("ns", "p", "u1", "n1", {"carpool.dev/assignment": "{}"},
                                     "42")

    seen = run_against(201, {"kind": "Status", "status": "Success"}, bind)
    assert seen == [{
        "path": "/api/v1/namespaces/ns/pods/p/binding", "auth": "Bearer tok",
        "body": {"apiVersion": "v1", "kind": "Binding",
                 "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                              "resourceVersion": "42",
                              "annotations": {"carpool.dev/assignment": "{}"}},
                 "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}}]


def test_a_refused_binding_raises_with_the_status_and_the_servers_message() -> None:
    async def bind(cluster: KubeCluster) -> None:
        with pytest.raises(ClusterError) as raised:
            await cluster.bind_pod_async("ns", "p", "", "n1", {})
        assert raised.value.status == 409
        assert "the object has been modified" in str(raised.value)

    run_against(409, {"kind": "Status", "message": "the object has been modified"}, bind)


def test_an_unreachable_api_server_is_status_0() -> None:
    async def main() -> None:
        cluster = KubeCluster(Api(client.Configuration(host="http://127.0.0.1:9")))
        try:
            with pytest.raises(ClusterError) as raised:
                await cluster.bind_pod_async("ns", "p", "", "n1", {})
            assert raised.value.status == 0
        finally:
            await cluster.close()

    asyncio.run(main())
