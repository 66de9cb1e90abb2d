"""The extender's HTTP face (aiohttp): the scheduler verbs, health and Prometheus metrics.

Routes are thin: read the body (size-limited), decode, call `Extender`, encode. Malformed
requests get HTTP 400 with `{"Error": ...}`; a body over the limit gets 413. Filter and
prioritize are pure CPU over the cache and run inline; bind's Binding write is asynchronous
(aiohttp) and its rare blocking calls (reading a pod) go to a thread pool. Between requests
a warmer keeps the placement memo complete (see `Ranker.warm`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from carpool.extender.service import CACHE_KINDS, Extender
from carpool.extender.wire import (
    ArgsReader,
    WireError,
    decode_binding_args,
    dump_json,
    parse_json,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 16 * 2**20  # a full ExtenderArgs with Nodes for ~2,000 nodes fits
# The warmer's longest stretch on the event loop. A request meets several of them before its
# handler starts (the loop takes a turn to read it, one to start the connection's task, one
# to start the handler): with 2-ms steps a filter waits ~10 ms while the warmer is busy, with
# 0.5-ms steps 4-5 ms (bench/extender.py's time-to-handler).
WARM_STEP_S = 0.0005
WARM_IDLE_S = 0.05  # how often it looks for changed nodes when it has nothing to do
GC_FREEZE_EVERY_S = 10.0  # when idle, move surviving objects out of the collector's scans
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# The young generation's threshold: how many container objects may be allocated (net)
# before a collection. CPython's default (700) ran one or two collections inside every
# prioritize at 1,213 nodes (its answer alone is 1,213 dicts), each walking the request's
# big, still-live dicts; most of what a request allocates is freed by reference counting
# when it ends, so collecting less often mostly skips work.
YOUNG_THRESHOLD = 20_000
# The warm loop collects the young generation between requests once this many objects may
# be in it, well before the interpreter would: a new shape's first filter allocates a few
# thousand objects, and a collection inside it lands on the slowest requests. "May be":
# the interpreter's count is allocations minus frees, and each evaluation the warmer
# replaces frees an old one, so the warmer's evaluations are counted as well.
YOUNG_COLLECT_AT = 5_000
SWITCH_INTERVAL_S = 0.001  # the most the event loop waits for a watch thread's interpreter


def tune_interpreter(young: int = YOUNG_THRESHOLD,
                     switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Process-wide settings for serving (the command and the benchmark call this)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
    sys.setswitchinterval(switch_interval_s)


def event_loop() -> asyncio.AbstractEventLoop:
    """The serving loop: uvloop's. Per pod the extender answers two requests and makes one
    Binding request, each several turns of the loop, and asyncio's own loop and transports
    were a good share of the process's CPU (bench/extender.py prints it per pod)."""
    return uvloop.new_event_loop()


EXTENDER_KEY = web.AppKey("extender", Extender)
POOL_KEY = web.AppKey("bind_pool", ThreadPoolExecutor)
WARMER_KEY = web.AppKey("warmer", asyncio.Task[None])


class Metrics:
    """The extender's Prometheus series, in their own registry."""

    def __init__(self, extender: Extender) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("carpool_extender_request_seconds",
                                 "Time to answer a scheduler request", ["verb"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("carpool_extender_requests_total", "Scheduler requests",
                                ["verb", "outcome"], registry=self.registry)
        self._latency: dict[str, Any] = {}
        self._requests: dict[tuple[str, str], Any] = {}
        self.filtered_out = Counter("carpool_extender_filtered_nodes_total",
                                    "Nodes filter rejected", registry=self.registry)
        cache_gauge = Gauge("carpool_extender_cache_objects", "Objects in the extender cache",
                            ["kind"], registry=self.registry)
        for kind in ("nodes", "holds", "assumed"):
            cache_gauge.labels(kind).set_function(self._counter(extender, kind))
        events = Gauge("carpool_extender_watch_events", "Watch events applied to the cache "
                       "since start", ["kind"], registry=self.registry)
        for kind in CACHE_KINDS:
            events.labels(kind).set_function(self._events(extender, kind))

    def record(self, verb: str, outcome: str, seconds: float) -> None:
        """One request's latency and outcome. (`labels` looks its child up on each call, a
        good part of a small request's time: the children are kept here instead.)"""
        latency = self._latency.get(verb)
        if latency is None:
            latency = self._latency[verb] = self.latency.labels(verb)
        latency.observe(seconds)
        count = self._requests.get((verb, outcome))
        if count is None:
            count = self._requests[(verb, outcome)] = self.requests.labels(verb, outcome)
        count.inc()

    @staticmethod
    def _counter(extender: Extender, kind: str) -> Callable[[], float]:
        return lambda: float(extender.cache.counts()[kind])

    @staticmethod
    def _events(extender: Extender, kind: str) -> Callable[[], float]:
        return lambda: float(extender.cache.events[kind])


METRICS_KEY = web.AppKey("metrics", Metrics)
ARGS_KEY = web.AppKey("args", ArgsReader)


def _bad_request(message: str, status: int = 400) -> web.Response:
    return web.json_response({"Error": message}, status=status)


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise WireError(f"request body too large: {exc.text}") from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _verb(name: str, work: Callable[[web.Request, bytes], Awaitable[Any]]) -> Handler:
    """Wrap one verb (given the body; it decodes it): time, count, and turn bad input into
    400 (never a 500)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        metrics = request.app[METRICS_KEY]
        started = time.perf_counter()
        outcome = "ok"
        try:
            try:
                body = await _read_body(request)
            except WireError as exc:
                outcome = "bad_request"
                status = 413 if "too large" in str(exc) else 400
                return _bad_request(str(exc), status)
            try:
                result = await work(request, body)
            except WireError as exc:
                outcome = "bad_request"
                return _bad_request(str(exc))
            if isinstance(result, dict) and result.get("Error"):
                outcome = "error"
            return web.Response(body=dump_json(result), content_type="application/json")
        except Exception as exc:  # a bug must not take the scheduler's extender down
            log.exception("%s failed", name)
            outcome = "internal_error"
            return _bad_request(f"internal error: {type(exc).__name__}: {exc}", 500)
        finally:
            metrics.record(name, outcome, time.perf_counter() - started)

    return handler


async def _filter(request: web.Request, body: bytes) -> Any:
    extender = request.app[EXTENDER_KEY]
    result = extender.filter(request.app[ARGS_KEY].read(body))
    metrics = request.app[METRICS_KEY]
    metrics.filtered_out.inc(len(result["FailedNodes"]) + len(result["FailedAndUnresolvableNodes"]))
    return result


async def _prioritize(request: web.Request, body: bytes) -> Any:
    return request.app[EXTENDER_KEY].prioritize(request.app[ARGS_KEY].read(body))


async def _bind(request: web.Request, body: bytes) -> Any:
    args = decode_binding_args(parse_json(body))
    loop = asyncio.get_running_loop()
    pool = request.app[POOL_KEY]

    async def in_pool(fn: Callable[..., Any], *fn_args: Any) -> Any:
        return await loop.run_in_executor(pool, fn, *fn_args)

    return await request.app[EXTENDER_KEY].bind_async(args, in_pool)


async def _healthz(request: web.Request) -> web.Response:
    if request.app[EXTENDER_KEY].cache.synced(CACHE_KINDS):
        return web.Response(text="ok\n")
    return web.Response(status=503, text="cache not synced yet\n")


async def _livez(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    return web.Response(body=generate_latest(metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(extender: Extender, max_body: int = DEFAULT_MAX_BODY,
             bind_threads: int = 64) -> web.Application:
    """The aiohttp application; `max_body` bounds every request body."""
    app = web.Application(client_max_size=max_body)
    app[EXTENDER_KEY] = extender
    app[METRICS_KEY] = Metrics(extender)
    app[ARGS_KEY] = ArgsReader()
    pool = ThreadPoolExecutor(max_workers=bind_threads, thread_name_prefix="bind")
    app[POOL_KEY] = pool

    async def warm_loop() -> None:
        frozen_at = -GC_FREEZE_EVERY_S
        warmed_at = 0  # the warmer's evaluations at the last collection
        while True:
            try:
                more = extender.warm(WARM_STEP_S)
            except Exception:  # keep serving; the requests evaluate what the warmer did not
                log.exception("warming the placement memo failed")
                more = False
            if not more and time.monotonic() - frozen_at >= GC_FREEZE_EVERY_S:
                # The memo and the cache are hundreds of thousands of long-lived objects; a
                # full cycle collection over them took up to 200 ms at 1,213 nodes, stalling
                # whatever request was in flight. Frozen objects are still freed by reference
                # counting (they hold no cycles); the collector just stops rescanning them.
                # Every 10 s, not every second: the collection before freezing is a stall
                # too, and a few longer ones touch fewer requests than many short ones.
                gc.collect(1)  # young cyclic garbage first, so it is not frozen with the rest
                gc.freeze()
                frozen_at = time.monotonic()
                warmed_at = extender.ranker.warmed
            elif gc.get_count()[0] + extender.ranker.warmed - warmed_at >= YOUNG_COLLECT_AT:
                gc.collect(0)
                warmed_at = extender.ranker.warmed
            await asyncio.sleep(0 if more else WARM_IDLE_S)

    async def start_warming(app: web.Application) -> None:
        extender.ranker.background_warming = extender.needs_warming
        app[WARMER_KEY] = asyncio.get_running_loop().create_task(warm_loop())

    async def shutdown(app: web.Application) -> None:
        if WARMER_KEY in app:
            app[WARMER_KEY].cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(extender.cluster, "close", None)
        if close is not None:
            await close()

    app.on_startup.append(start_warming)
    app.on_cleanup.append(shutdown)
    app.router.add_post("/filter", _verb("filter", _filter))
    app.router.add_post("/prioritize", _verb("prioritize", _prioritize))
    app.router.add_post("/bind", _verb("bind", _bind))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/livez", _livez)
    app.router.add_get("/metrics", _metrics)
    return app
