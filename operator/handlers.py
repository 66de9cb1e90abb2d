"""kopf entry point: `kopf run -m carpool.operator.handlers`.

kopf hosts the operator's lifecycle (startup, cleanup, the liveness probe); the operator
follows GpuJobs, ProjectQuotas, GpuNodes, Nodes and Carpool's pods with its own watch caches
(informer.py), whose events only wake the reconcile loop, which (on the leader only)
re-derives state from the caches and acts. Its Events and its accounting finalizer are its
own too (docs/architecture.md says why, with kopf's watches, Event queue and finalizer
tried and measured). Writes never happen on events, so a non-leader replica, a missed event
or a restart cannot make two replicas act or leave state half-applied.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from carpool.operator.runtime import OperatorRuntime

log = logging.getLogger(__name__)
RUNTIME_KEY = "carpool_runtime"


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # the operator posts its own Events (kopf's queue is reachable only from handlers of
    # objects kopf watches); kopf's about its own handling would only add noise
    settings.posting.enabled = False
    runtime = OperatorRuntime.from_environment(os.environ)
    memo[RUNTIME_KEY] = runtime
    runtime.start()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    runtime: OperatorRuntime | None = memo.get(RUNTIME_KEY)
    if runtime is not None:
        await runtime.stop()


@kopf.on.probe(id="leader")
async def leader_probe(memo: kopf.Memo, **_: Any) -> bool:
    runtime: OperatorRuntime | None = memo.get(RUNTIME_KEY)
    return bool(runtime and runtime.elector.is_leader())
