"""Prometheus metrics (`carpool_gpu_*`), in a registry of their own so tests can read them."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from carpool.deviceplugin.backends.base import GpuFacts
from carpool.deviceplugin.telemetry import PodPeak


class GpuMetrics:
    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        self.node = node
        self.registry = registry or CollectorRegistry()
        labels = ["node", "gpu", "uuid", "model"]
        r = self.registry
        self.memory_used = Gauge("carpool_gpu_memory_used_mib", "GPU memory in use", labels,
                                 registry=r)
        self.memory_total = Gauge("carpool_gpu_memory_total_mib", "GPU memory", labels, registry=r)
        self.temperature = Gauge("carpool_gpu_temperature_celsius", "GPU temperature", labels,
                                 registry=r)
        self.slowdown = Gauge("carpool_gpu_slowdown_temperature_celsius",
                              "Temperature at which the GPU throttles", labels, registry=r)
        self.power = Gauge("carpool_gpu_power_watts", "GPU power draw", labels, registry=r)
        self.utilization = Gauge("carpool_gpu_utilization_percent", "GPU busy time", labels,
                                 registry=r)
        self.healthy = Gauge("carpool_gpu_healthy", "1 when the GPU is healthy", labels,
                             registry=r)
        self.pod_peak = Gauge("carpool_gpu_pod_memory_peak_mib",
                              "Peak GPU memory of a pod's processes",
                              ["node", "namespace", "pod", "uuid"], registry=r)
        self.allocations = Counter("carpool_gpu_allocations", "Allocate answers",
                                   ["node", "isolation", "result"], registry=r)
        self.watchdog_kills = Counter("carpool_gpu_watchdog_kills",
                                      "Pods killed for exceeding GPU memory in timeslice mode",
                                      ["node"], registry=r)
        self.health_changes = Counter("carpool_gpu_health_changes",
                                      "GPU health transitions", ["node", "to"], registry=r)

    def observe(self, gpus: Iterable[GpuFacts], unhealthy: Collection[str]) -> None:
        for g in gpus:
            labels = (self.node, str(g.index), g.uuid, g.model)
            self.memory_used.labels(*labels).set(g.memory_used_mib)
            self.memory_total.labels(*labels).set(g.memory_total_mib)
            self.temperature.labels(*labels).set(g.temperature_c)
            self.slowdown.labels(*labels).set(g.slowdown_temperature_c)
            self.power.labels(*labels).set(g.power_w)
            self.utilization.labels(*labels).set(g.utilization_pct)
            self.healthy.labels(*labels).set(1 if g.healthy and g.uuid not in unhealthy else 0)

    def observe_peaks(self, peaks: Iterable[PodPeak]) -> None:
        self.pod_peak.clear()
        for p in peaks:
            self.pod_peak.labels(self.node, p.namespace, p.name, p.gpu_uuid).set(p.peak_memory_mib)
