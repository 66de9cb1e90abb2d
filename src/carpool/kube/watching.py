"""List, then watch: one loop that keeps a local view of one kind current.

A `Reflector` lists the kind (in pages), hands the items over, then follows a watch from the
list's resourceVersion; a watch the server ends (its timeout) is resumed from the last
version seen, and an expired version (410 Gone, an ERROR event), a broken stream or any
failure leads to a fresh list after a backoff. Bodies are decoded with orjson into plain
dicts: the thread shares the interpreter with whatever else the process does, so its time
per event is time taken from that.

`Store` is the view most callers want: the newest object per key, the newest version it
reflects (`wait_for`, for a caller that must see its own writes), and the objects first seen
by the watch (`arrived_since`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from carpool.kube.client import Api, Obj
from carpool.kube.errors import Gone
from carpool.kube.resources import Resource
from carpool.kube.retry import Backoff

log = logging.getLogger(__name__)
WATCH_SECONDS = 240  # the server ends each watch after this; it is then resumed
ARRIVALS_KEPT = 1024  # newest objects first seen by the watch (`Store.arrived_since`)
GONE_KEPT = 4096  # newest objects the watch saw deleted (`Store.gone_at`)


class WatchEnded(Exception):
    """The watch cannot be resumed (an ERROR event, e.g. 410 Gone): list again."""


def object_key(obj: Mapping[str, Any]) -> str:
    """`namespace/name`, or `name` for a cluster-scoped object."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def version_of(obj: Mapping[str, Any]) -> int:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else 0


class Reflector:
    """List + watch of one resource on a thread of its own (or the caller's, with `run`).

    `on_list(items, version)` gets every list; `on_event(type, obj)` each ADDED, MODIFIED or
    DELETED; `on_error(err)` each failure before the next list.
    """

    def __init__(self, api: Api, resource: Resource, *,
                 on_list: Callable[[list[Obj], str], None],
                 on_event: Callable[[str, Obj], None],
                 on_error: Callable[[Exception], None] = lambda err: None,
                 on_bookmark: Callable[[str], None] = lambda version: None,
                 label_selector: str = "", field_selector: str = "",
                 watch_seconds: int = WATCH_SECONDS, backoff: Backoff | None = None,
                 name: str = "") -> None:
        self.api = api
        self.resource = resource
        self.name = name or resource.plural
        self._on_list = on_list
        self._on_event = on_event
        self._on_error = on_error
        self._on_bookmark = on_bookmark
        self._selectors = {k: v for k, v in (("labelSelector", label_selector),
                                             ("fieldSelector", field_selector)) if v}
        self._watch_seconds = watch_seconds
        self._backoff = backoff or Backoff()
        self.version = ""  # the newest resourceVersion handed over
        self.relists = 0
        self._stop = threading.Event()
        self._relist = threading.Event()
        self._response: Any = None  # the watch being read, so `relist` can interrupt it
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"watch-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._interrupt()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def relist(self) -> None:
        """List again soon (a caller found the view behind); interrupts the watch."""
        self._relist.set()
        self._interrupt()

    def run(self) -> None:
        """List and watch until `stop`."""
        while not self._stop.is_set():
            try:
                self._list()
                self._backoff.reset()
                while not self._stop.is_set() and not self._relist.is_set():
                    self._watch()
            except Exception as err:  # API down, RBAC, 410, a broken stream: list again
                if self._stop.is_set():
                    break
                if not (isinstance(err, WatchEnded | Gone) or self._relist.is_set()):
                    log.warning("watch of %s: %s; listing again", self.name, err)
                self._on_error(err)
                if not self._relist.is_set() and self._backoff.wait(self._stop):
                    break

    def _interrupt(self) -> None:
        response = self._response
        if response is not None:
            try:
                response.shutdown()
            except Exception as err:  # already closed
                log.debug("interrupting the %s watch: %s", self.name, err)

    def _list(self) -> None:
        self._relist.clear()
        items, version = self.api.list_all(self.resource.path(), self._selectors)
        self.version = version
        self.relists += 1
        self._on_list(items, version)

    def _watch(self) -> None:
        """Follow one watch request until the server ends it."""
        query = {**self._selectors, "watch": "1", "allowWatchBookmarks": "true",
                 "resourceVersion": self.version, "timeoutSeconds": self._watch_seconds}
        response = self.api.stream(self.resource.path(), query, self._watch_seconds + 30)
        self._response = response
        try:
            pending = b""
            for chunk in response.stream(65536):
                if b"\n" not in chunk:  # one event may span many chunks
                    pending += chunk
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(orjson.loads(line))
                if self._stop.is_set() or self._relist.is_set():
                    return
        finally:
            self._response = None
            response.release_conn()

    def _event(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # 410 Gone (compacted) and others: only a list recovers
            raise WatchEnded(f"{obj.get('code', '')} {obj.get('message', obj)}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.version = str(version)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._on_event(str(kind), obj)
        elif kind == "BOOKMARK" and version:
            self._on_bookmark(str(version))


class Store:
    """The newest object of each key of one kind, kept by a `Reflector`.

    `keep` trims what is stored of each object (a big store should hold only what its reader
    reads); `changed` is called after every list and every event but bookmarks.
    """

    def __init__(self, api: Api, resource: Resource, *, label_selector: str = "",
                 field_selector: str = "", keep: Callable[[Obj], Obj] = lambda obj: obj,
                 changed: Callable[[], None] = lambda: None, arrivals: bool = False,
                 backoff: Backoff | None = None, name: str = "") -> None:
        self.name = name or resource.plural
        self.items: dict[str, Obj] = {}
        self.version = 0  # the newest resourceVersion this store reflects
        self.synced = False
        self.arrived = 0  # objects first seen by a watch event (a list counts none)
        self.arrivals: deque[Obj] | None = deque(maxlen=ARRIVALS_KEPT) if arrivals else None
        # uid -> (when the watch showed it deleted, its last state), newest GONE_KEPT
        self._gone: OrderedDict[str, tuple[float, Obj]] = OrderedDict()
        self._keep = keep
        self._changed = changed
        self._cond = threading.Condition()
        self.reflector = Reflector(api, resource, on_list=self._replace, on_event=self._apply,
                                   on_bookmark=self._bookmark,
                                   label_selector=label_selector,
                                   field_selector=field_selector, backoff=backoff,
                                   name=self.name)

    @property
    def relists(self) -> int:
        return self.reflector.relists

    def start(self) -> None:
        self.reflector.start()

    def stop(self) -> None:
        self.reflector.stop()

    def relist(self) -> None:
        self.reflector.relist()

    def snapshot(self) -> list[Obj]:
        """The current objects (stored objects are replaced, never changed in place)."""
        with self._cond:
            return list(self.items.values())

    def get(self, key: str) -> Obj | None:
        return self.items.get(key)

    def wait_for(self, version: int, timeout: float) -> bool:
        """True once the store has listed and reflects `version`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.synced and self.version >= version):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def arrived_since(self, count: int) -> list[Obj] | None:
        """The objects first shown after `arrived` was `count`; None if more arrived than
        the store remembers."""
        with self._cond:
            arrivals = self.arrivals if self.arrivals is not None else deque()
            new = self.arrived - count
            if new > len(arrivals):
                return None
            return list(arrivals)[len(arrivals) - new:] if new > 0 else []

    def gone_at(self, uid: str) -> tuple[float, Obj] | None:
        """When the watch showed the object of `uid` deleted (epoch seconds), or a fresh list
        first lacked it (it went before then: the watch was down or restarted), with its
        last state as this store held it; None if neither."""
        with self._cond:
            return self._gone.get(uid)

    def gone(self) -> list[tuple[float, Obj]]:
        """Every object the store remembers as gone (see `gone_at`), oldest first."""
        with self._cond:
            return list(self._gone.values())

    def _replace(self, items: list[Obj], version: str) -> None:
        fresh = {object_key(obj): self._keep(obj) for obj in items}
        with self._cond:
            listed = {_uid(obj) for obj in fresh.values()}
            for old in self.items.values():
                if (uid := _uid(old)) and uid not in listed and uid not in self._gone:
                    self._forget(uid, time.time(), old)
            self.items = fresh
            self.version = max(self.version, int(version) if version.isdigit() else 0)
            self.synced = True
            self._cond.notify_all()
        self._changed()

    def _forget(self, uid: str, at: float, last: Obj) -> None:
        self._gone[uid] = (at, last)
        if len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    def _bookmark(self, version: str) -> None:
        with self._cond:
            self.version = max(self.version, int(version) if version.isdigit() else 0)
            self._cond.notify_all()

    def _apply(self, kind: str, obj: Obj) -> None:
        with self._cond:
            key = object_key(obj)
            if kind == "DELETED":
                self.items.pop(key, None)
                if uid := _uid(obj):
                    self._forget(uid, time.time(), self._keep(obj))
            else:
                kept = self._keep(obj)
                if self.arrivals is not None and kind == "ADDED" and key not in self.items:
                    self.arrived += 1
                    self.arrivals.append(kept)
                self.items[key] = kept
            self.version = max(self.version, version_of(obj))
            self._cond.notify_all()
        self._changed()
