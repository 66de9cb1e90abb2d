"""Leader election on a coordination.k8s.io Lease, so that of several replicas only one acts.

The reconcile loop asks `is_leader()` before every write pass. Leadership is held only while
the last successful renewal is younger than the lease duration, so a replica cut off from the
API server stops acting before another may take over (renew deadline < lease duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class LeaseConfig:
    name: str = "carpool-operator"
    namespace: str = "default"
    lease_seconds: float = 15.0
    retry_seconds: float = 2.0


class LeaderElector:
    """Acquires and renews one Lease; `is_leader()` is true only while the lease is ours.

    `is_leader()` reads a monotonic clock only, so the reconcile thread may call it.
    """

    def __init__(self, api: client.ApiClient, config: LeaseConfig,
                 identity: str | None = None):
        self.api = client.CoordinationV1Api(api)
        self.config = config
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._renewed_at: float | None = None

    def is_leader(self) -> bool:
        if self._renewed_at is None:
            return False
        renew_deadline = self.config.lease_seconds * 0.66
        return time.monotonic() - self._renewed_at < renew_deadline

    async def run(self, stop: asyncio.Event) -> None:
        """Try to acquire or renew every retry period until `stop` is set; then release."""
        while not stop.is_set():
            try:
                held = await asyncio.to_thread(self._try_acquire_or_renew)
            except Exception as err:  # API down: keep trying, leadership lapses by itself
                log.warning("lease %s: %s", self.config.name, err)
                held = False
            if held:
                if self._renewed_at is None:
                    log.info("became leader as %s", self.identity)
                self._renewed_at = time.monotonic()
            elif self._renewed_at is not None and not self.is_leader():
                log.info("lost leadership")
                self._renewed_at = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.retry_seconds)
        await asyncio.to_thread(self._release)

    def _spec(self, acquire_time: Any) -> dict[str, Any]:
        now = _now()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.config.lease_seconds),
            "acquireTime": acquire_time or now.isoformat(),
            "renewTime": now.isoformat(),
        }

    def _try_acquire_or_renew(self) -> bool:
        cfg = self.config
        try:
            lease = self.api.read_namespaced_lease(cfg.name, cfg.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            body = {"metadata": {"name": cfg.name}, "spec": self._spec(None)}
            try:
                self.api.create_namespaced_lease(cfg.namespace, body)
                return True
            except ApiException as create_err:
                if create_err.status == 409:
                    return False
                raise
        spec = lease.spec
        holder = spec.holder_identity
        renew = spec.renew_time
        duration = spec.lease_duration_seconds or cfg.lease_seconds
        expired = renew is None or (_now() - renew).total_seconds() > duration
        if holder not in (self.identity, None, "") and not expired:
            return False
        mine = holder == self.identity and spec.acquire_time
        acquire = spec.acquire_time.isoformat() if mine else None
        body = {
            "metadata": {"name": cfg.name, "resourceVersion": lease.metadata.resource_version},
            "spec": self._spec(acquire),
        }
        try:
            self.api.replace_namespaced_lease(cfg.name, cfg.namespace, body)
        except ApiException as err:
            if err.status == 409:  # someone else renewed or took it first
                return False
            raise
        return True

    def _release(self) -> None:
        """Give the lease up on clean shutdown so a standby takes over at once."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
            if lease.spec.holder_identity == self.identity:
                body = {
                    "metadata": {"name": self.config.name,
                                 "resourceVersion": lease.metadata.resource_version},
                    "spec": {"holderIdentity": "", "leaseDurationSeconds": 1},
                }
                self.api.replace_namespaced_lease(self.config.name, self.config.namespace, body)
        except Exception as err:
            log.warning("could not release lease: %s", err)
