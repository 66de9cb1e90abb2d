"""The user-space service proxy's reading of EndpointSlices."""

from __future__ import annotations

from typing import Any

from carpool_testbed import serviceproxy


def _slice(ports: list[dict[str, Any]], endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ports": ports, "endpoints": endpoints}


def test_only_ready_endpoints_with_the_named_port_are_served() -> None:
    slices = {"items": [
        _slice([{"name": "https", "port": 6443}],
               [{"addresses": ["10.88.77.1"], "conditions": {"ready": True}}]),
        _slice([{"name": "https", "port": 6443}],
               [{"addresses": ["10.88.77.9"], "conditions": {"ready": False}}]),
        _slice([{"name": "metrics", "port": 9090}],
               [{"addresses": ["10.88.77.5"], "conditions": {"ready": True}}]),
    ]}
    assert serviceproxy.ready_endpoints(slices, "https", 443) == [("10.88.77.1", 6443)]


def test_an_unnamed_port_and_missing_conditions_count_as_ready() -> None:
    slices = {"items": [_slice([{"port": 18080}], [{"addresses": ["10.88.77.7", "10.88.77.8"]}])]}
    assert serviceproxy.ready_endpoints(slices, "", 18080) == [("10.88.77.7", 18080),
                                                                 ("10.88.77.8", 18080)]
    assert serviceproxy.ready_endpoints(None, "", 18080) == []


def test_connections_take_the_endpoints_in_turn() -> None:
    route = serviceproxy.Route("ns/svc", "10.0.0.155", 18080, "",
                               [("10.88.77.7", 18080), ("10.88.77.8", 18080)])
    assert [route.pick() for _ in range(3)] == [("10.88.77.7", 18080), ("10.88.77.8", 18080),
                                                ("10.88.77.7", 18080)]
    assert serviceproxy.Route("ns/svc", "10.0.0.155", 18080, "").pick() is None
