"""kopf entry point: `kopf run -m carpool.operator.handlers`.

kopf watches GpuJobs, ProjectQuotas, GpuNodes and Carpool's pods; every event only wakes the
reconcile loop, which (on the leader only) re-derives state from full lists and acts. Writes
never happen in event handlers, so a non-leader replica, a missed event or a restart cannot
make two replicas act or leave state half-applied.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from carpool.operator.runtime import OperatorRuntime

from carpool.core import names

log = logging.getLogger(__name__)
RUNTIME_KEY = "carpool_runtime"


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False  # we post our own Events, with our own reasons
    # Event handlers only wake the loop; a log line per watch event costs more CPU than the
    # handler itself at thousands of GpuJobs and pods.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings.watching.server_timeout = 300
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    runtime = OperatorRuntime.from_environment(os.environ)
    memo[RUNTIME_KEY] = runtime
    runtime.start()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    runtime: OperatorRuntime | None = memo.get(RUNTIME_KEY)
    if runtime is not None:
        await runtime.stop()


def _poke(memo: kopf.Memo) -> None:
    runtime: OperatorRuntime | None = memo.get(RUNTIME_KEY)
    if runtime is not None:
        runtime.poke()


@kopf.on.event(names.GROUP, names.VERSION, names.GPUJOB_PLURAL)
async def gpujob_event(memo: kopf.Memo, **_: Any) -> None:
    _poke(memo)


@kopf.on.event(names.GROUP, names.VERSION, names.PROJECTQUOTA_PLURAL)
async def quota_event(memo: kopf.Memo, **_: Any) -> None:
    _poke(memo)


@kopf.on.event(names.GROUP, names.VERSION, names.GPUNODE_PLURAL)
async def gpunode_event(memo: kopf.Memo, **_: Any) -> None:
    _poke(memo)


@kopf.on.event("v1", "pods", labels={names.LABEL_MANAGED: "true"})
async def pod_event(memo: kopf.Memo, **_: Any) -> None:
    _poke(memo)


@kopf.on.probe(id="leader")
async def leader_probe(memo: kopf.Memo, **_: Any) -> bool:
    runtime: OperatorRuntime | None = memo.get(RUNTIME_KEY)
    return bool(runtime and runtime.elector.is_leader())

