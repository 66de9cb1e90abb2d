"""Leader election on a coordination.k8s.io Lease, so that of several replicas only one acts.

A caller asks `is_leader()` before acting. Leadership counts only while the last successful
renewal is younger than the renew deadline (2/3 of the lease), so a replica cut off from the
API server stops acting before another may take the lease over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from carpool.core.timestamps import epoch_of, format_timestamp_micro
from carpool.kube.client import Api, Obj
from carpool.kube.errors import Conflict, NotFound
from carpool.kube.resources import LEASES
from carpool.kube.retry import Backoff

log = logging.getLogger(__name__)


@dataclass
class LeaseConfig:
    name: str = "carpool-operator"
    namespace: str = "default"
    lease_seconds: float = 15.0
    retry_seconds: float = 2.0


class LeaderElector:
    """Acquires and renews one Lease; `is_leader()` is true only while the lease is ours.

    `is_leader()` reads a monotonic clock only, so any thread may call it.
    """

    def __init__(self, api: Api, config: LeaseConfig, identity: str | None = None):
        self.api = api
        self.config = config
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._renewed_at: float | None = None
        # a failing API server is retried sooner than the renew period, up to that period
        self._backoff = Backoff(first=min(0.5, config.retry_seconds), most=config.retry_seconds)

    @property
    def _path(self) -> str:
        return LEASES.path(self.config.namespace, self.config.name)

    def is_leader(self) -> bool:
        if self._renewed_at is None:
            return False
        renew_deadline = self.config.lease_seconds * 0.66
        return time.monotonic() - self._renewed_at < renew_deadline

    async def run(self, stop: asyncio.Event) -> None:
        """Try to acquire or renew every retry period until `stop` is set; then release."""
        while not stop.is_set():
            wait = self.config.retry_seconds
            try:
                held = await asyncio.to_thread(self.try_acquire_or_renew)
                self._backoff.reset()
            except Exception as err:  # API down: keep trying, leadership lapses by itself
                log.warning("lease %s: %s", self.config.name, err)
                held = False
                wait = self._backoff.next()
            if held:
                if self._renewed_at is None:
                    log.info("became leader as %s", self.identity)
                self._renewed_at = time.monotonic()
            elif self._renewed_at is not None and not self.is_leader():
                log.info("lost leadership")
                self._renewed_at = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        await asyncio.to_thread(self.release)

    def _spec(self, acquire_time: Any) -> Obj:
        now = format_timestamp_micro(time.time())
        return {"holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.config.lease_seconds),
                "acquireTime": acquire_time or now, "renewTime": now}

    def try_acquire_or_renew(self) -> bool:
        """One round: True if the lease is ours after it."""
        cfg = self.config
        lease = self.api.get(self._path)
        if lease is None:
            body = {"apiVersion": LEASES.api_version, "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                    "spec": self._spec(None)}
            try:
                self.api.create(LEASES.path(cfg.namespace), body)
            except Conflict:  # another replica created it first
                return False
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = epoch_of(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds") or cfg.lease_seconds
        expired = renewed is None or time.time() - renewed > duration
        if holder not in (self.identity, None, "") and not expired:
            return False
        mine = holder == self.identity and spec.get("acquireTime")
        body = {"apiVersion": LEASES.api_version, "kind": "Lease",
                "metadata": {"name": cfg.name, "namespace": cfg.namespace,
                             "resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": self._spec(spec["acquireTime"] if mine else None)}
        try:
            self.api.request("PUT", self._path, body)
        except Conflict:  # someone else renewed or took it first
            return False
        return True

    def release(self) -> None:
        """Give the lease up on clean shutdown so a standby takes over at once."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = self.api.get(self._path)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") \
                    == self.identity:
                body = {"apiVersion": LEASES.api_version, "kind": "Lease",
                        "metadata": {"name": self.config.name,
                                     "namespace": self.config.namespace,
                                     "resourceVersion": lease["metadata"]["resourceVersion"]},
                        "spec": {"holderIdentity": "", "leaseDurationSeconds": 1}}
                self.api.request("PUT", self._path, body)
        except (NotFound, Conflict):
            pass
        except Exception as err:
            log.warning("could not release lease: %s", err)
