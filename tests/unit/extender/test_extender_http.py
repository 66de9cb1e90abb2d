"""The extender's HTTP layer: Go field names on the wire, 400 for bad input, never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.core import names
from carpool.extender.cache import ClusterCache
from carpool.extender.fake import FakeCluster, gpunode_object, node_object, pod_object
from carpool.extender.server import make_app
from carpool.extender.service import Extender, Settings


def world() -> tuple[Extender, FakeCluster]:
    cache = ClusterCache()
    for kind in ("nodes", "gpunodes", "pods", "gpujobs"):
        cache.mark_synced(kind)
    cluster = FakeCluster(on_change=lambda event, pod: cache.apply_pod(event, pod, 0.0))
    for name, temp in (("n1", 40.0), ("n2", 70.0)):
        cache.apply_node("ADDED", node_object(name))
        cache.apply_gpunode("ADDED", gpunode_object(
            name, [{"uuid": f"{name}-g0", "model": "A100", "temperatureC": temp}]))
    return Extender(cache, cluster, Settings(), clock=lambda: 0.0), cluster


Call = Callable[[str, Any], Awaitable[tuple[int, Any]]]


def serve(extender: Extender, check: Callable[[Call], Awaitable[None]],
          max_body: int = 1 << 20) -> None:
    """Run `check` against the app on a real local port (the scheduler's view)."""

    async def main() -> None:
        runner = web.AppRunner(make_app(extender, max_body=max_body))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:

            async def call(path: str, body: Any) -> tuple[int, Any]:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with session.post(f"http://127.0.0.1:{port}{path}", data=data,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    text = await resp.text()
                    try:
                        return resp.status, json.loads(text)
                    except ValueError:
                        return resp.status, text

            await check(call)
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                assert "carpool_extender_request_seconds" in await resp.text()
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
        await runner.cleanup()

    asyncio.run(main())


def test_filter_prioritize_bind_round_trip_with_go_field_names() -> None:
    extender, cluster = world()
    pod = pod_object("p", memory_gib=10)
    cluster.add_pod(pod)

    async def check(call: Call) -> None:
        status, result = await call("/filter", {"Pod": pod, "NodeNames": ["n1", "n2", "n3"]})
        assert status == 200
        assert result["NodeNames"] == ["n1", "n2"]
        assert set(result["FailedAndUnresolvableNodes"]) == {"n3"}
        assert result["Error"] == ""
        status, result = await call("/prioritize", {"Pod": pod, "NodeNames": ["n1", "n2"]})
        assert status == 200
        assert result == [{"Host": "n1", "Score": 10}, {"Host": "n2", "Score": 0}]
        status, result = await call("/bind", {"PodName": "p", "PodNamespace": "default",
                                              "PodUID": "uid-p", "Node": "n1"})
        assert (status, result) == (200, {"Error": ""})

    serve(extender, check)
    assert cluster.bindings == [("default/p", "n1")]
    assert names.ANN_ASSIGNMENT in cluster.pod("default", "p")["metadata"]["annotations"]


def test_full_nodes_are_echoed_when_the_scheduler_is_not_cache_capable() -> None:
    extender, _ = world()
    pod = pod_object("p", memory_gib=10)
    nodes = {"items": [node_object("n1"), node_object("n3")]}

    async def check(call: Call) -> None:
        status, result = await call("/filter", {"Pod": pod, "Nodes": nodes})
        assert status == 200
        assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1"]

    serve(extender, check)


@pytest.mark.parametrize("path,body,fragment", [
    ("/filter", b"{not json", "not valid JSON"),
    ("/filter", b"[]", "ExtenderArgs must be a JSON object"),
    ("/filter", {"NodeNames": ["n1"]}, "ExtenderArgs.Pod must be a JSON object"),
    ("/filter", {"Pod": {"metadata": {}, "spec": {}}}, "needs NodeNames or Nodes"),
    ("/filter", {"Pod": {}, "NodeNames": "n1"}, "NodeNames must be a list"),
    ("/prioritize", {"Pod": {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "c", "resources": {"limits": {"carpool.dev/gpu": "1.5"}}}]}},
        "NodeNames": ["n1"]}, "whole number"),
    ("/bind", {"PodName": "p"}, "PodNamespace must be a non-empty string"),
    ("/bind", b"\xff\xfe", "not valid JSON"),
    ("/filter", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_bad_input_is_a_400_with_a_reason(path: str, body: Any, fragment: str) -> None:
    extender, _ = world()

    async def check(call: Call) -> None:
        status, result = await call(path, body)
        assert status == 400
        assert fragment in result["Error"]

    serve(extender, check)


def test_an_oversized_body_is_refused() -> None:
    extender, _ = world()

    async def check(call: Call) -> None:
        status, result = await call("/filter", b"{" + b" " * 5000 + b"}")
        assert status == 413
        assert "too large" in result["Error"]

    serve(extender, check, max_body=4096)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
POD_PARTS = st.fixed_dictionaries({}, optional={
    "metadata": st.fixed_dictionaries({}, optional={
        "name": JSON | st.just("p"), "namespace": JSON, "uid": JSON,
        "annotations": st.dictionaries(st.sampled_from([
            names.ANN_ISOLATION, names.ANN_MODELS, names.ANN_DATASET, names.ANN_DATASET_SIZE,
            names.ANN_POLICY, names.ANN_ASSIGNMENT]), JSON | st.text(max_size=12)) | JSON}),
    "spec": st.fixed_dictionaries({}, optional={"containers": st.lists(
        st.fixed_dictionaries({}, optional={"name": JSON, "resources": st.fixed_dictionaries(
            {}, optional={"limits": st.dictionaries(st.sampled_from([
                names.RESOURCE_GPU, names.RESOURCE_GPU_MEMORY, names.RESOURCE_GPU_CORES]),
                JSON | st.text(max_size=6)) | JSON}) | JSON}), max_size=3) | JSON}),
})
BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries({"Pod": POD_PARTS | JSON},
                          optional={"NodeNames": st.lists(st.sampled_from(["n1", "n2", "x"]))
                                    | JSON, "Nodes": JSON}),
    st.fixed_dictionaries({}, optional={"PodName": JSON, "PodNamespace": JSON,
                                        "PodUID": JSON, "Node": JSON}),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES, path=st.sampled_from(["/filter", "/prioritize", "/bind"]))
def test_fuzzed_requests_never_crash_the_extender(body: Any, path: str) -> None:
    extender, _ = world()

    async def check(call: Call) -> None:
        status, result = await call(path, json.dumps(body, allow_nan=True).encode())
        assert status in (200, 400), result
        if status == 400:
            assert result["Error"]

    serve(extender, check)


def test_the_args_reader_decodes_bodies_as_the_plain_decoder_and_reuses_repeated_names(
) -> None:
    import orjson

    from carpool.extender.wire import ArgsReader, WireError, decode_extender_args, parse_json

    reader = ArgsReader()
    pod = {"metadata": {"name": "p", "annotations": {"x": '"NodeNames":["a"]'}}}
    bodies = [
        orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": ["n1", "n2"]}),  # as Go writes
        orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": ["n1", "n2"]}),  # the same again
        orjson.dumps({"Pod": pod, "NodeNames": ["n2"]}),
        orjson.dumps({"NodeNames": ["n1"], "Pod": pod}),
        json.dumps({"Pod": pod, "NodeNames": ["n1", "n3"]}).encode(),  # spaces: parsed whole
        orjson.dumps({"Pod": pod, "NodeNames": ["odd]name", "n1"]}),
        orjson.dumps({"Pod": pod, "NodeNames": []}),
    ]
    for body in bodies:
        assert reader.read(body) == decode_extender_args(parse_json(body))
    first, again = reader.read(bodies[0]), reader.read(bodies[1])
    assert first.node_names is again.node_names  # not parsed again
    with pytest.raises(WireError, match="NodeNames must be a list of strings"):
        reader.read(orjson.dumps({"Pod": pod, "NodeNames": ["n1", 2]}))
    with pytest.raises(WireError, match="not valid JSON"):
        reader.read(b'{"Pod": {}, "NodeNames":["n1"],')
