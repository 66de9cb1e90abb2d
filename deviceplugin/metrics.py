"""Prometheus metrics (`carpool_gpu_*`), in a registry of their own so tests can read them."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from carpool.core.service_levels import ServiceMeasure
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
        job = ["node", "namespace", "job", "model"]
        self.service_throughput = Gauge(
            "carpool_service_throughput", "Successful requests per second a job served over "
            "its last report's window", job, registry=r)
        self.service_p99 = Gauge("carpool_service_p99_latency_seconds",
                                 "99th-percentile request latency of a job's last report", job,
                                 registry=r)
        self.service_failure_ratio = Gauge(
            "carpool_service_failure_ratio", "Failed requests over all finished, last report",
            job, registry=r)
        self.service_sharing = Gauge("carpool_service_sharing",
                                     "Jobs on the job's GPU when it last reported (itself too)",
                                     job, registry=r)
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

    def observe_services(self, measures: Mapping[str, tuple[tuple[str, str], ServiceMeasure]]
                         ) -> None:
        """The latest service measure of each job on this node (`reports.ReportReader`)."""
        gauges = (self.service_throughput, self.service_p99, self.service_failure_ratio,
                  self.service_sharing)
        for gauge in gauges:
            gauge.clear()
        for (namespace, name), m in measures.values():
            labels = (self.node, namespace, name, m.gpu_model)
            self.service_throughput.labels(*labels).set(m.report.throughput)
            if m.report.p99_s is not None:
                self.service_p99.labels(*labels).set(m.report.p99_s)
            self.service_failure_ratio.labels(*labels).set(m.report.failure_rate)
            self.service_sharing.labels(*labels).set(m.sharing)
