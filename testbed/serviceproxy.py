"""ClusterIPs for the real node's pods without iptables: a forwarder in user space.

`python -m carpool_testbed.serviceproxy --kubeconfig K --service NS/NAME ...` (the real node
starts it with `--service-proxy userspace`). Machines without netfilter tools (such as
a GPU machine with no iptables) cannot run kube-proxy, and pods still reach the API server and the
extender through their Services' ClusterIPs. This puts each named Service's ClusterIP on the
loopback device, listens on its ports and hands every connection to one of the Service's ready
endpoints, read through kubectl every few seconds. Pods route to the ClusterIP through their
gateway (the node), which now owns that address. Only TCP; no session affinity, no NodePorts:
what Carpool's pods need and nothing more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REFRESH_S = 2.0
CONNECT_TIMEOUT_S = 5.0
LOOPBACK = "lo"


@dataclass
class Route:
    """One Service port: where it listens (ClusterIP, port) and its ready endpoints."""

    service: str
    cluster_ip: str
    port: int
    port_name: str
    endpoints: list[tuple[str, int]] = field(default_factory=list)
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self) -> tuple[str, int] | None:
        if not self.endpoints:
            return None
        return self.endpoints[next(self.turn) % len(self.endpoints)]


def kubectl_json(kubectl: Sequence[str], *args: str) -> Any:
    done = subprocess.run([*kubectl, *args, "-o", "json"], capture_output=True, text=True,
                          timeout=30, check=False)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout)


def ready_endpoints(slices: Any, port_name: str, target: int) -> list[tuple[str, int]]:
    """The ready addresses of a Service's EndpointSlices, with the port named `port_name`."""
    found = []
    for item in (slices or {}).get("items", []):
        ports = {p.get("name") or "": p.get("port") for p in item.get("ports") or []}
        port = ports.get(port_name, target if not ports else None)
        if port is None:
            continue
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready", True):
                found += [(address, int(port)) for address in endpoint.get("addresses", [])]
    return sorted(found)


def service_routes(kubectl: Sequence[str], service: str) -> list[Route]:
    namespace, name = service.split("/", 1)
    svc = kubectl_json(kubectl, "get", "service", name, "-n", namespace)
    if not svc or svc["spec"].get("clusterIP") in (None, "", "None"):
        return []
    return [Route(service, svc["spec"]["clusterIP"], int(p["port"]), p.get("name") or "")
            for p in svc["spec"].get("ports", []) if p.get("protocol", "TCP") == "TCP"]


def refresh(kubectl: Sequence[str], routes: list[Route]) -> None:
    by_service: dict[str, list[Route]] = {}
    for route in routes:
        by_service.setdefault(route.service, []).append(route)
    for service, group in by_service.items():
        namespace, name = service.split("/", 1)
        slices = kubectl_json(kubectl, "get", "endpointslices", "-n", namespace, "-l",
                              f"kubernetes.io/service-name={name}")
        for route in group:
            route.endpoints = ready_endpoints(slices, route.port_name, route.port)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def handler(route: Route) -> Any:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = route.pick()
        if target is None:
            writer.close()
            return
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*target),
                                              CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError):
            writer.close()
            return
        up_reader, up_writer = upstream
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    return handle


def own_address(address: str) -> None:
    """Puts `address`/32 on the loopback device (idempotent)."""
    shown = subprocess.run(["ip", "-4", "addr", "show", "dev", LOOPBACK], capture_output=True,
                           text=True, check=False).stdout
    if f"inet {address}/" not in shown:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", LOOPBACK], check=True,
                       capture_output=True)


def release_addresses(addresses: Sequence[str]) -> None:
    for address in addresses:
        subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", LOOPBACK],
                       capture_output=True, check=False)


async def serve(kubectl: Sequence[str], services: Sequence[str]) -> None:
    routes: list[Route] = []
    listening: set[tuple[str, int]] = set()
    while True:
        for service in services:
            if not any(r.service == service for r in routes):
                routes += service_routes(kubectl, service)
        await asyncio.to_thread(refresh, kubectl, routes)
        for route in routes:
            if (route.cluster_ip, route.port) in listening:
                continue
            own_address(route.cluster_ip)
            await asyncio.start_server(handler(route), route.cluster_ip, route.port,
                                       reuse_address=True)
            listening.add((route.cluster_ip, route.port))
            print(f"serving {route.service} at {route.cluster_ip}:{route.port} -> "
                  f"{route.endpoints}", flush=True)
        await asyncio.sleep(REFRESH_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool_testbed.serviceproxy",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubectl", required=True, help="the kubectl binary")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--service", action="append", required=True, metavar="NS/NAME",
                        help="a Service to serve (repeatable); it may appear later")
    parser.add_argument("--release", action="store_true",
                        help="remove the ClusterIPs of these Services from lo and exit")
    args = parser.parse_args(argv)
    kubectl = [args.kubectl, "--kubeconfig", args.kubeconfig]
    if args.release:
        release_addresses(sorted({r.cluster_ip for s in args.service
                                  for r in service_routes(kubectl, s)}))
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(kubectl, args.service))
    return 0


if __name__ == "__main__":
    sys.exit(main())
