"""Which containers this node's plugin already served, kept on the host across restarts.

Allocate carries no pod identity: the plugin picks the one in-flight container of the
requested count (handshake.py) and marks its pod `carpool.dev/allocated`. If that mark is lost
(the API server refused or was down) and the plugin then restarts, the served pod, still
Pending while its containers start, looks in flight again, and the next same-count Allocate
could be matched to it and hand the new container the old pod's GPUs. So every hand-over is
written here, atomically and before Allocate answers, and read back at start.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

Served = tuple[str, str]  # (pod uid, container)


class HandOverJournal:
    """A small JSON file of (pod uid, container) pairs; `None` path keeps it in memory only."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load(self) -> set[Served]:
        """What an earlier run of this plugin served; an unreadable file counts as empty (said
        in the log), since refusing to start would take the node's GPUs away."""
        if self.path is None or not self.path.exists():
            return set()
        try:
            entries = json.loads(self.path.read_text())
            return {(str(uid), str(container)) for uid, container in entries}
        except (OSError, ValueError, TypeError) as err:
            log.error("ignoring unreadable hand-over journal %s: %s", self.path, err)
            return set()

    def save(self, served: Iterable[Served]) -> None:
        """Replace the file's content (write a temporary file, fsync, rename)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        with temporary.open("w") as f:
            json.dump(sorted(served), f)
            f.flush()
            os.fsync(f.fileno())
        temporary.replace(self.path)


def still_relevant(served: Iterable[Served], live_uids: Iterable[str]) -> set[Served]:
    """Drop entries of pods no longer on the node, so the journal stays small."""
    live = set(live_uids)
    return {entry for entry in served if entry[0] in live}
