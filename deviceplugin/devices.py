"""The device IDs the plugin advertises: shares of each GPU, by sharing mode."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from carpool.core.gpunode import SHARING_MODES
from carpool.core.shares import ShareId, shares_of
from carpool.deviceplugin.backends.base import GpuFacts


@dataclass(frozen=True)
class AdvertisedShare:
    share: ShareId
    healthy: bool


def share_count(gpu: GpuFacts, mode: str, shares_per_gpu: int) -> int:
    """How many pods may hold this GPU at once: one per MIG instance on a MIG GPU, one on an
    exclusive node, otherwise `shares_per_gpu` (the extender decides who really fits)."""
    if gpu.mig_enabled:
        return len(gpu.mig_instances)
    if mode in ("exclusive", "mig"):
        return 1
    return shares_per_gpu


def advertised_shares(
    gpus: Sequence[GpuFacts],
    mode: str,
    shares_per_gpu: int,
    unhealthy: Collection[str] = frozenset(),
) -> list[AdvertisedShare]:
    """Every share of every GPU, in GPU index order; shares of an unhealthy GPU are unhealthy."""
    if mode not in SHARING_MODES:
        raise ValueError(
            f"unknown sharing mode {mode!r}; expected one of {', '.join(SHARING_MODES)}")
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        healthy = gpu.healthy and gpu.uuid not in unhealthy
        for share in shares_of(gpu.uuid, share_count(gpu, mode, shares_per_gpu)):
            out.append(AdvertisedShare(share, healthy))
    return out
