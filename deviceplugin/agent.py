"""The node agent's periodic work beside the gRPC server: health, telemetry, the watchdog.

Each `*_step` does one round and is what the tests drive; `run_*` loops call them forever.
Blocking backend calls (NVML) run in a worker thread so the gRPC server keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from carpool.core.resources import Isolation
from carpool.deviceplugin.handshake import ServedPod, assignment_on
from carpool.deviceplugin.plugin import PluginState
from carpool.deviceplugin.telemetry import (
    PodPeak,
    PublishThresholds,
    cached_datasets,
    gpunode_status,
    should_publish,
)
from carpool.deviceplugin.watchdog import (
    MemoryGrant,
    PodGpu,
    Verdict,
    pod_of_pid,
    usage_by_pod,
    watchdog_step,
)

log = logging.getLogger(__name__)


class ClusterWriter(Protocol):
    async def publish_status(self, node: str, status: Mapping[str, Any]) -> None:
        """Write the node's GpuNode status (creating the GpuNode if needed)."""
        ...

    async def pod_event(self, pod: ServedPod, reason: str, message: str, warning: bool) -> None:
        ...


async def health_step(state: PluginState, wait_s: float) -> bool:
    """Take driver events (waiting up to `wait_s`), re-probe unhealthy GPUs, refresh readings.
    Wakes the ListAndWatch streams when the advertised devices changed (a GPU's health, or its
    MIG instances); returns whether they did."""
    backend = state.backend
    events = await asyncio.to_thread(backend.health_events, wait_s)
    now = state.clock()
    devices_before = state.shares()
    health_changed = state.health.record(events, now)
    health_changed |= await asyncio.to_thread(state.health.recheck, backend.probe, now)
    state.gpus = await asyncio.to_thread(backend.inventory)
    state.metrics.observe(state.gpus, state.health.unhealthy)
    await asyncio.to_thread(state.refresh_cdi_spec)  # a new MIG layout: its devices first
    if health_changed:
        sick = sorted(state.health.unhealthy)
        log.warning("GPU health changed; unhealthy now: %s", sick or "none")
        state.metrics.health_changes.labels(state.config.node,
                                            "Unhealthy" if sick else "Healthy").inc()
    if state.shares() == devices_before:
        return False
    await state.changed()
    return True


ACTIVITY_STEP_S = 60  # pods' last activity is published to the minute


@dataclass
class Telemetry:
    """Rate-limited GpuNode status publishing, plus per-pod peak memory bookkeeping."""

    state: PluginState
    writer: ClusterWriter
    dataset_dir: Path | None = None
    thresholds: PublishThresholds = field(default_factory=PublishThresholds)
    monotonic: Callable[[], float] = time.monotonic
    peaks: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # (namespace, pod, GPU) -> when its processes last used the GPU's SMs, to the next minute
    # (a reading every few seconds must not rewrite the status each time); None: the
    # backend does not measure it
    active: dict[tuple[str, str, str], float] | None = None
    _last: dict[str, Any] | None = None
    _last_at: float = 0.0

    def record_usage(self, usage: Mapping[tuple[str, str, str], int]) -> None:
        """Fold in a reading of (namespace, pod, GPU) -> MiB; pods no longer seen are dropped."""
        self.peaks = {k: max(self.peaks.get(k, 0), v) for k, v in usage.items()}
        if self.active is not None:
            self.active = {k: v for k, v in self.active.items() if k in self.peaks}

    def record_activity(self, working: Iterable[tuple[str, str, str]] | None,
                        now: float) -> None:
        """The (namespace, pod, GPU)s whose processes used the GPU since the last reading
        (None: the backend cannot tell)."""
        if working is None:
            self.active = None
            return
        # up to the next minute: rounding may make a pod look busy a little longer, never idle
        minute = math.ceil(now / ACTIVITY_STEP_S) * ACTIVITY_STEP_S
        self.active = {**(self.active or {}), **dict.fromkeys(working, minute)}

    async def step(self) -> bool:
        state = self.state
        status = gpunode_status(
            state.gpus,
            driver_version=await asyncio.to_thread(state.backend.driver_version),
            cuda_version=await asyncio.to_thread(state.backend.cuda_version),
            sharing_mode=state.config.sharing_mode,
            now=datetime.now(UTC),
            unhealthy=state.health.unhealthy,
            datasets=cached_datasets(self.dataset_dir),
            pod_peaks=[PodPeak(ns, name, gpu, mib, (self.active or {}).get((ns, name, gpu)))
                       for (ns, name, gpu), mib in self.peaks.items()],
            process_activity=self.active is not None,
            shares_per_gpu=state.config.shares_per_gpu,
            mps_ceiling_pct=state.config.mps.ceiling_pct,
            health_reasons={u: state.health.reason(u) for u in state.health.unhealthy},
        )
        now = self.monotonic()
        if not should_publish(self._last, self._last_at, status, now, self.thresholds):
            return False
        await self.writer.publish_status(state.config.node, status)
        self._last, self._last_at = status, now
        return True


WATCHED = (Isolation.TIMESLICE.value, Isolation.MPS.value)


def watched_grants(pods: list[ServedPod], node: str, node_mode: str) -> list[MemoryGrant]:
    """Memory grants of the running time-sliced and MPS pods on `node`, from their assignments.

    Time-sliced pods have no other memory limit. An MPS client is fenced by the daemon only at
    the GPU's ceiling (mps.py), so one that raised its own limit above its grant is caught here;
    NVML lists MPS clients by pid with their own memory."""
    grants = []
    for pod in pods:
        if pod.phase not in ("Running", "Pending") or pod.deleting:
            continue
        assignment = assignment_on(pod, node)
        # the isolation the extender recorded (from the job's spec), not the pod's annotation
        recorded = assignment.isolation if assignment is not None else None
        isolation = recorded.value if recorded is not None else node_mode
        if isolation not in WATCHED:
            continue
        for g in assignment.gpus if assignment is not None else ():
            grants.append(MemoryGrant(pod.uid, pod.namespace, pod.name, g.uuid, g.memory_mib))
    return grants


@dataclass
class Watchdog:
    state: PluginState
    writer: ClusterWriter
    telemetry: Telemetry | None = None
    max_strikes: int = 3
    pod_of: Callable[[int], str | None] = pod_of_pid
    kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL)
    strikes: dict[PodGpu, int] = field(default_factory=dict)

    async def step(self) -> list[str]:
        """One reading; returns what it did, one line per warning or kill."""
        state = self.state
        processes = await asyncio.to_thread(state.backend.process_memory)
        pod_of = {p.pid: self.pod_of(p.pid) for p in processes}
        usage = usage_by_pod(processes, pod_of)
        pods = await state.pods.pods_on_node(state.config.node)
        by_uid = {p.uid: p for p in pods}
        if self.telemetry is not None:
            self.telemetry.record_usage({
                (by_uid[uid].namespace, by_uid[uid].name, gpu): used
                for (uid, gpu), (used, _) in usage.items() if uid in by_uid
            })
            activity = await asyncio.to_thread(state.backend.process_activity)
            self.telemetry.record_activity(
                None if activity is None else
                [(pod.namespace, pod.name, a.gpu_uuid) for a in activity
                 if (uid := pod_of.get(a.pid) or self.pod_of(a.pid)) and (pod := by_uid.get(uid))],
                time.time())
            state.metrics.observe_peaks(
                PodPeak(ns, name, gpu, mib) for (ns, name, gpu), mib in self.telemetry.peaks.items()
            )
        grants = watched_grants(pods, state.config.node, state.config.sharing_mode)
        self.strikes, violations = watchdog_step(self.strikes, usage, grants, self.max_strikes)
        done = []
        for v in violations:
            g = v.grant
            text = (f"pod {g.namespace}/{g.name} uses {v.used_mib} MiB on GPU {g.gpu_uuid}, "
                    f"over its {g.limit_mib} MiB grant (reading {v.strike} of {self.max_strikes})")
            pod = by_uid.get(g.pod_uid)
            if v.verdict is Verdict.KILL:
                for pid in v.pids:
                    with contextlib.suppress(ProcessLookupError):
                        self.kill(pid)
                text = f"killed {len(v.pids)} process(es): {text}"
                state.metrics.watchdog_kills.labels(state.config.node).inc()
            log.warning("%s", text)
            if pod is not None:
                reason = "GpuMemoryKilled" if v.verdict is Verdict.KILL else "GpuMemoryOverGrant"
                try:
                    await self.writer.pod_event(pod, reason, text, warning=True)
                except Exception as err:
                    log.error("could not post event for %s: %s", pod.key, err)
            done.append(text)
        return done


async def run_every(period_s: float, step: Callable[[], Any], what: str) -> None:
    """Call `step` forever, `period_s` apart; a failing round is logged, never fatal."""
    while True:
        try:
            await step()
        except Exception:
            log.exception("%s failed; trying again in %.0fs", what, period_s)
        await asyncio.sleep(period_s)
