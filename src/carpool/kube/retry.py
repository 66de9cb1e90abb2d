"""Waiting between attempts: one exponential backoff for every loop that retries the API
server (watches, leases, marks) or the kubelet.

Delays grow from `first` by `factor` up to `most`, and start over after a success (`reset`),
so a short outage costs a fraction of a second and a long one polls at `most`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first: float = 0.2
    most: float = 10.0
    factor: float = 2.0
    _next: float = field(init=False, repr=False, default=0.0)

    def __post_init__(self) -> None:
        self._next = self.first

    def next(self) -> float:
        """The delay before the next attempt (and grow the one after it)."""
        delay = self._next
        self._next = min(self.most, self._next * self.factor)
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits `first` again."""
        self._next = self.first

    def delays(self, attempts: int) -> Iterator[float]:
        """The delays of `attempts` attempts, from the start (a bounded retry)."""
        self.reset()
        for _ in range(attempts):
            yield self.next()

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay on a thread; True if `stop` was set meanwhile."""
        return stop.wait(self.next())

    async def sleep(self) -> None:
        """Sleep the next delay on the event loop."""
        await asyncio.sleep(self.next())
