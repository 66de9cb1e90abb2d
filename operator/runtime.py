"""The operator's long-running parts: leader election, watch caches, the reconcile loop.

Started by kopf's startup handler; the loop runs a pass when poked by a watch event (batched:
events arriving during a pass cause one more pass, not one each) or every resync period.
Every replica keeps its caches warm; only the leader runs passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from carpool.kube.client import Api
from carpool.kube.leases import LeaderElector, LeaseConfig
from carpool.operator.informer import Informers
from carpool.operator.kube import Kube
from carpool.operator.reconciler import CacheBehind, Reconciler, ReconcilerConfig
from carpool.operator.settings import OperatorSettings

log = logging.getLogger(__name__)


@dataclass
class RuntimeConfig:
    namespace: str = "default"
    resync_seconds: float = 5.0
    min_pass_interval: float = 0.2
    metrics_port: int = 0  # 0: no metrics server


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Fewer glibc malloc arenas (default: 8 per core, one per busy thread): the operator's
    ~30 I/O threads each fragmenting an arena of their own cost more RSS than the objects.
    Must run before the threads start; a no-op where libc is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX


class OperatorRuntime:
    def __init__(self, api: Api, runtime: RuntimeConfig,
                 reconciler_config: ReconcilerConfig, identity: str | None = None):
        self.config = runtime
        self.elector = LeaderElector(api, LeaseConfig(namespace=runtime.namespace), identity)
        kube = Kube(api)  # one record of our own writes, for the caches' fence
        self.informers = Informers(kube, self._poke_from_thread)
        self.reconciler = Reconciler(kube, reconciler_config, self.informers)
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._poke_pending = False  # a wake-up is already on its way to the loop
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> OperatorRuntime:
        settings = OperatorSettings.from_environment(env)  # a bad value stops it here
        logging.getLogger("carpool").setLevel(settings.log_level)
        # write workers + events + lease + watches share one pool
        api = Api.load(settings.kubeconfig or None, pool_size=64,
                       user_agent="carpool-operator")
        runtime = RuntimeConfig(namespace=settings.namespace, resync_seconds=settings.resync_s,
                                metrics_port=settings.metrics_port)
        return cls(api, runtime, ReconcilerConfig.from_settings(settings),
                   settings.identity or None)

    def start(self) -> None:
        limit_malloc_arenas()
        if self.config.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.config.metrics_port)
        self._loop_ref = asyncio.get_running_loop()
        self.informers.start()
        self._tasks = [asyncio.create_task(self.elector.run(self._stop)),
                       asyncio.create_task(self._loop())]

    def _poke_from_thread(self) -> None:
        """Wake the loop from a watch thread; one wake-up in flight at a time (watch events
        come in thousands per second during a burst)."""
        loop = self._loop_ref
        if loop is None or self._poke_pending:
            return
        self._poke_pending = True
        try:
            loop.call_soon_threadsafe(self._poked)
        except RuntimeError:  # the loop has closed: shutting down
            self._poke_pending = False

    def _poked(self) -> None:
        self._poke_pending = False
        self._wake.set()

    async def stop(self) -> None:
        self.informers.stop()
        self._stop.set()
        self._wake.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.resync_seconds)
            self._wake.clear()
            if self._stop.is_set():
                break
            if not self.elector.is_leader():
                continue
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.reconciler.run_pass, time.time(),
                                        self.elector.is_leader)
            except CacheBehind as err:
                log.warning("reconcile pass skipped: %s", err)
                await asyncio.sleep(0.2)
            except Exception:
                log.exception("reconcile pass failed; retrying")
                await asyncio.sleep(1.0)
            spent = time.monotonic() - started
            if spent < self.config.min_pass_interval:
                await asyncio.sleep(self.config.min_pass_interval - spent)
