"""The extender's in-memory view of the cluster: nodes, their GPUs, and who holds what.

Fed by watches (see `watching`) and by the extender's own binds. A pod's GPUs count as held
from the moment bind *assumes* them (before anything is written to the API server) until the
pod is deleted or terminates; the watch *confirms* an assumption when it shows the pod with
the assignment annotation, and a failed bind *forgets* it. The GPUs an admitted gang's
admission chose for a worker whose pod is not bound yet (its GpuJob's status.workers, written
by the operator) are *reserved* for that worker: no other pod takes them while its gang is
being bound, so a gang never starts with a worker left out. Every read and every
choose-and-assume happens under one short lock around this memory only — never across an
HTTP or API call — so two concurrent binds can never both take the same free capacity.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from carpool.core import interference, names
from carpool.core.assignment import (
    HAND_OVER_STALE_S,
    Assignment,
    AssignmentError,
    parse_assignment,
)
from carpool.core.decoding import (
    first_image,
    gpu_request_from_spec,
    placements_from_status,
    worker_requests_from_spec,
)
from carpool.core.finalizing import deletion_final
from carpool.core.jobs import job_template
from carpool.core.lending import LendingPolicy, lendable, split
from carpool.core.ownership import Owner
from carpool.core.placement import NodeState
from carpool.core.resources import GpuGrant, GpuRequest, Isolation, NodeInventory, Phase
from carpool.core.timestamps import epoch_of
from carpool.extender.inventory import InventoryError, inventory_from_objects
from carpool.extender.states import CachedState
from carpool.extender.wire import pod_requests

IN_FLIGHT_STALE_S = HAND_OVER_STALE_S  # the handshake rule's last-resort timeout
ASSUMED_TTL_S = 300.0  # an assumption the watch never confirmed is dropped after this
CHANGE_LOG = 100_000  # node changes kept for `changes_since` (a reader further behind relists)
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class Hold:
    """GPUs one pod holds (or is about to hold) on one node."""

    pod_key: str
    uid: str
    node: str
    grants: tuple[GpuGrant, ...]
    gpu_counts: frozenset[int]  # per-container GPU counts (the handshake compares these)
    assigned_at: float  # epoch seconds
    settled: bool = False  # the device plugin took it over, or the pod runs
    assumed: bool = False  # only the extender's belief so far
    cpu_milli: int = 0  # the pod's CPU and memory requests (assumed holds: until the watch
    memory_mib: int = 0  # shows the pod on its node)

    def in_flight(self, now: float) -> bool:
        """Bound (or binding) but not yet handed over, within the staleness timeout."""
        return not self.settled and now - self.assigned_at < IN_FLIGHT_STALE_S


@dataclass(frozen=True)
class Snapshot:
    """Candidate nodes as one pod's handlers see them (the pod's own holds left out)."""

    states: dict[str, NodeState]  # the known nodes among those asked for
    missing: dict[str, str]  # the others, with the reason there is no state
    in_flight: dict[str, tuple[Hold, ...]]  # only nodes with another pod in flight


@dataclass(frozen=True)
class PodView:
    """What is particular to one pod on the cluster's nodes (see `ClusterCache.pod_view`)."""

    in_flight: dict[str, tuple[Hold, ...]]  # nodes with another pod in flight
    own: tuple[str, NodeState] | None  # the node of the pod's own hold, without it


UNKNOWN_NODE = "node is unknown to the Carpool extender (no Node object seen)"


@dataclass(frozen=True)
class Refused:
    """A bind step that cannot go on; `reason` is what the scheduler is told."""

    reason: str


@dataclass(frozen=True)
class InFlightClash:
    """A reserve refusal that clears by itself once the in-flight pod is handed over."""

    reason: str


Chooser = Callable[[NodeState], tuple[Assignment, tuple[GpuGrant, ...]] | Refused]


def _pod_peaks(gpunode: Mapping[str, Any] | None) -> dict[tuple[str, str], int]:
    """(namespace/name, GPU UUID) -> peak GPU memory (MiB) the node's device plugin saw."""
    out: dict[tuple[str, str], int] = {}
    for entry in ((gpunode or {}).get("status") or {}).get("pods") or ():
        try:
            key = (f"{entry['namespace']}/{entry['name']}", str(entry["gpuUuid"]))
            out[key] = int(entry.get("peakMemoryMiB") or 0)
        except (KeyError, TypeError, ValueError):
            continue
    return out


# A bound pod's watch events (its binding, then the kubelet's status updates) carry the same
# assignment annotation: it is parsed once, not on each (the assignment is immutable).
_parsed_assignment = lru_cache(maxsize=8192)(parse_assignment)


def _pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


class ClusterCache:
    """Thread-safe; watches call `apply_*`/`replace_*`, handlers call `views`/`reserve`."""

    def __init__(self, lending: LendingPolicy | None = None) -> None:
        # lend owners' unused memory (core.lending): their grants are split by the peaks the
        # node's GpuNode reports, so borrowers' grants sit in the lent parts
        self.lending = lending
        self._peaks: dict[str, dict[tuple[str, str], int]] = {}  # node -> (pod, GPU) -> MiB
        self._lock = threading.Lock()
        self._nodes: dict[str, Mapping[str, Any]] = {}
        self._gpunodes: dict[str, Mapping[str, Any]] = {}
        self._inventories: dict[str, NodeInventory] = {}
        self._broken: dict[str, str] = {}  # node -> why its GpuNode could not be read
        self._observed: dict[str, Hold] = {}  # from pod annotations, as the watch shows them
        self._assumed: dict[str, Hold] = {}  # from our binds, until confirmed or forgotten
        # a gang worker's GPUs, by its pod, from its admitted GpuJob's status.workers
        self._reserved: dict[str, Hold] = {}
        self._reserved_by_job: dict[str, set[str]] = {}
        self._effective: dict[str, Hold] = {}  # assumed wins over observed, then reserved
        self._keys_on_node: dict[str, set[str]] = {}
        # effective holds that may still be in flight, by node (filter asks per node)
        self._unsettled: dict[str, set[str]] = {}
        self._states: dict[str, NodeState] = {}  # memoised per node; dropped on change
        self._changed: set[str] = set()  # nodes whose state was dropped (see drain_changed)
        self._log: list[str] = []  # the same, in order, for `changes_since`
        self._log_start = 0  # the position of `_log[0]`
        self._supply: Counter[str] = Counter()  # GPUs per model over the known nodes
        # CPU and memory requested on each node by the pods there (any pod, GPU or not):
        self._observed_usage: dict[str, tuple[str, int, int]] = {}  # from the watch
        self._usage: dict[str, tuple[str, int, int]] = {}  # effective: observed, else assumed
        self._node_usage: dict[str, tuple[int, int]] = {}
        self._synced: set[str] = set()
        # GpuJobs by namespace/name: (uid, the GPU request of their immutable spec)
        self._jobs: dict[str, tuple[str, GpuRequest | str]] = {}
        # what the jobs' service measures teach (core.interference): samples by job, each
        # job's template, and the profiles, learned again when a sample changes
        self._samples: dict[str, interference.Sample] = {}
        self._templates: dict[str, str] = {}
        self._profiles: interference.Profiles | None = interference.NO_PROFILES
        self._shapes: dict[str, tuple[GpuRequest, ...]] = {}  # a gang's worker requests
        # a gang's newest attempt whose workers all exist (GpuJob status.gangCreated)
        self._gang_created: dict[str, int] = {}
        self.pods_watch_healthy = False
        self.events: Counter[str] = Counter()  # watch events applied, per kind (metrics)
        self._expiry_checked = float("-inf")

    # --- sync state --------------------------------------------------------------------

    def mark_synced(self, kind: str) -> None:
        with self._lock:
            self._synced.add(kind)

    def synced(self, kinds: Iterable[str]) -> bool:
        with self._lock:
            return all(k in self._synced for k in kinds)

    # --- nodes -------------------------------------------------------------------------

    def put_inventory(self, inventory: NodeInventory) -> None:
        """Set a node's inventory directly (benchmarks and tests; no Node object needed)."""
        with self._lock:
            self._set_inventory(inventory.name, inventory)

    def _set_inventory(self, name: str, inventory: NodeInventory | None) -> None:
        old = self._inventories.pop(name, None)
        if old is not None:
            for gpu in old.gpus:
                self._supply[gpu.model] -= 1
        if inventory is not None:
            self._inventories[name] = inventory
            for gpu in inventory.gpus:
                self._supply[gpu.model] += 1
        self._drop_state(name)

    def _drop_state(self, name: str) -> None:
        self._states.pop(name, None)
        self._changed.add(name)
        self._log.append(name)
        if len(self._log) > CHANGE_LOG:
            half = CHANGE_LOG // 2
            del self._log[:half]
            self._log_start += half

    def _rebuild_inventory(self, name: str) -> None:
        node = self._nodes.get(name)
        self._broken.pop(name, None)
        if node is None:
            self._set_inventory(name, None)
            return
        try:
            inventory = inventory_from_objects(node, self._gpunodes.get(name))
        except InventoryError as exc:
            self._set_inventory(name, None)
            self._broken[name] = str(exc)
            return
        if inventory != self._inventories.get(name):
            # Heartbeats and unchanged readings leave it equal: keeping the old object keeps
            # the node's memoised state and every evaluation made on it.
            self._set_inventory(name, inventory)
        if self.lending is not None:
            peaks = _pod_peaks(self._gpunodes.get(name))
            if peaks != self._peaks.get(name):
                self._peaks[name] = peaks
                self._drop_state(name)

    def apply_node(self, event: str, node: Mapping[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        with self._lock:
            self.events["nodes"] += 1
            if event == "DELETED":
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = node
            self._rebuild_inventory(name)

    def apply_gpunode(self, event: str, gpunode: Mapping[str, Any]) -> None:
        name = str((gpunode.get("metadata") or {}).get("name", ""))
        with self._lock:
            self.events["gpunodes"] += 1
            if event == "DELETED":
                self._gpunodes.pop(name, None)
            else:
                self._gpunodes[name] = gpunode
            self._rebuild_inventory(name)

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        fresh = {str(n["metadata"]["name"]): n for n in nodes}
        with self._lock:
            stale = set(self._nodes) | set(fresh)
            self._nodes = fresh
            for name in stale:
                self._rebuild_inventory(name)

    def replace_gpunodes(self, gpunodes: Iterable[Mapping[str, Any]]) -> None:
        fresh = {str(n["metadata"]["name"]): n for n in gpunodes}
        with self._lock:
            stale = set(self._gpunodes) | set(fresh)
            self._gpunodes = fresh
            for name in stale:
                self._rebuild_inventory(name)

    # --- GpuJobs: what a job's pod is checked against ---------------------------------

    def _set_job(self, job: Mapping[str, Any]) -> None:
        meta = job.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        try:
            request: GpuRequest | str = gpu_request_from_spec(job.get("spec") or {})
            shapes = worker_requests_from_spec(job.get("spec") or {})
        except ValueError as exc:
            request = f"its GpuJob's spec.gpu cannot be read: {exc}"
            shapes = ()
        self._jobs[key] = (str(meta.get("uid") or ""), request)
        created = (job.get("status") or {}).get("gangCreated")
        if isinstance(created, int) and not isinstance(created, bool):
            self._gang_created[key] = created
        else:
            self._gang_created.pop(key, None)
        self._templates[key] = job_template(str(meta.get("name", "")),
                                            first_image(job.get("spec") or {}))
        sample = interference.sample_of(job)
        if sample != self._samples.get(key):
            if sample is None:
                self._samples.pop(key, None)
            else:
                self._samples[key] = sample
            self._profiles = None
        self._shapes[key] = tuple(dict.fromkeys(shapes))
        self._reserve_workers(key, worker_reservations(job, request))

    def _reserve_workers(self, job_key: str, holds: Mapping[str, Hold]) -> None:
        """Make `holds` (by worker pod) the reservations of the gang `job_key`."""
        before = self._reserved_by_job.pop(job_key, set())
        if holds:
            self._reserved_by_job[job_key] = set(holds)
        for pod_key in before | set(holds):
            hold = holds.get(pod_key)
            if hold == self._reserved.get(pod_key):
                continue
            if hold is None:
                del self._reserved[pod_key]
            else:
                self._reserved[pod_key] = hold
            self._refresh(pod_key)

    def apply_gpujob(self, event: str, job: Mapping[str, Any]) -> None:
        meta = job.get("metadata") or {}
        with self._lock:
            self.events["gpujobs"] += 1
            if event == "DELETED":
                key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                self._jobs.pop(key, None)
                self._shapes.pop(key, None)
                self._gang_created.pop(key, None)
                self._reserve_workers(key, {})
                self._templates.pop(key, None)
                if self._samples.pop(key, None) is not None:
                    self._profiles = None
            else:
                self._set_job(job)

    def replace_gpujobs(self, jobs: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            self._jobs, self._templates, self._samples = {}, {}, {}
            self._profiles = None
            self._shapes = {}
            self._gang_created = {}
            for job in jobs:
                self._set_job(job)
            for gone in set(self._reserved_by_job) - set(self._jobs):
                self._reserve_workers(gone, {})

    def job_shapes(self, namespace: str, owner: Owner) -> tuple[GpuRequest, ...]:
        """The distinct requests of a gang's workers (spec.workers); empty for a one-pod job
        (its pod asks for `job_request`)."""
        with self._lock:
            known = self._jobs.get(f"{namespace}/{owner.name}")
            shapes = self._shapes.get(f"{namespace}/{owner.name}", ())
        return shapes if known is not None and known[0] == owner.uid else ()

    def job_request(self, namespace: str, owner: Owner) -> GpuRequest | str | None:
        """The GPU request of the GpuJob `owner` names in `namespace` when its uid is the one
        named (a job of that name created since is another job), why not when its spec
        cannot be read, None when the watch has not shown it."""
        key = f"{namespace}/{owner.name}"
        with self._lock:
            known = self._jobs.get(key)
            if known is None or known[0] != owner.uid:
                return None
            request = known[1]
            if isinstance(request, str):
                return request
            if self._profiles is None:
                self._profiles = interference.learn(self._samples.values())
            # with the sharing limits its template's profiles give (core.interference)
            return interference.limited(request, self._templates.get(key, ""), self._profiles)

    # --- pods --------------------------------------------------------------------------

    def _hold_from_pod(self, pod: Mapping[str, Any], now: float) -> Hold | None:
        """The hold a pod's assignment annotation records, or None if it holds nothing."""
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        status = pod.get("status") or {}
        text = annotations.get(names.ANN_ASSIGNMENT)
        if not text or status.get("phase") in TERMINAL_PHASES or deletion_final(meta):
            return None  # (a pod deleted with grace 0 is kept only by finalizers)
        try:
            assignment = _parsed_assignment(str(text))
        except AssignmentError:
            return None  # not ours to fix; the pod holds nothing we can account
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and node_name != assignment.node:
            return None  # bound elsewhere by someone else: the annotation is stale
        # the isolation the extender recorded at bind; a pod bound before it was recorded
        # says it in its annotation
        exclusive = assignment.isolation is Isolation.EXCLUSIVE or (
            assignment.isolation is None and str(annotations.get(names.ANN_ISOLATION, ""))
            .lower() == Isolation.EXCLUSIVE.value)
        inventory = self._inventories.get(assignment.node)
        totals = {g.uuid: g.memory_total_mib for g in inventory.gpus} if inventory else {}
        counts: dict[str, int] = {}
        for g in assignment.gpus:
            counts[g.container] = counts.get(g.container, 0) + 1
        assigned_at = epoch_of(annotations.get(names.ANN_ASSIGNED_AT))
        settled = bool(annotations.get(names.ANN_ALLOCATED)) or status.get("phase") == "Running"
        return Hold(
            pod_key=_pod_key(pod), uid=str(meta.get("uid", "")), node=assignment.node,
            grants=assignment.grants(exclusive, totals), gpu_counts=frozenset(counts.values()),
            assigned_at=now if assigned_at is None else assigned_at, settled=settled,
        )

    def _refresh(self, key: str) -> None:
        old = self._effective.pop(key, None)
        new = self._assumed.get(key) or self._observed.get(key) or self._reserved.get(key)
        if old is not None:
            self._settled(old.node, key)
        same_grants = (old is not None and new is not None and old.node == new.node
                       and old.grants == new.grants)
        if old is not None:
            self._keys_on_node.get(old.node, set()).discard(key)
            if not same_grants:  # keep the memoised state (and its evaluations) when we can
                self._drop_state(old.node)
        if new is not None:
            self._effective[key] = new
            self._keys_on_node.setdefault(new.node, set()).add(key)
            if not same_grants:
                self._drop_state(new.node)
            if not new.settled:
                self._unsettled.setdefault(new.node, set()).add(key)
        self._refresh_usage(key)

    def _settled(self, node: str, key: str) -> None:
        keys = self._unsettled.get(node)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._unsettled[node]

    def _refresh_usage(self, key: str) -> None:
        old = self._usage.pop(key, None)
        new = self._observed_usage.get(key)
        assumed = self._assumed.get(key)
        if new is None and assumed is not None:
            new = (assumed.node, assumed.cpu_milli, assumed.memory_mib)
        if new is not None and (new[1] or new[2]):
            self._usage[key] = new
        else:
            new = None
        if old == new:
            return
        for usage, sign in ((old, -1), (new, 1)):
            if usage is not None:
                node, cpu, memory = usage
                used_cpu, used_memory = self._node_usage.get(node, (0, 0))
                self._node_usage[node] = (used_cpu + sign * cpu, used_memory + sign * memory)
                self._drop_state(node)

    def _observe(self, pod: Mapping[str, Any], deleted: bool, now: float) -> str:
        key = _pod_key(pod)
        usage = None if deleted else _usage_of(pod)
        if usage is None:
            self._observed_usage.pop(key, None)
        else:
            self._observed_usage[key] = usage
        hold = None if deleted else self._hold_from_pod(pod, now)
        if hold is None:
            self._observed.pop(key, None)
        else:
            self._observed[key] = hold
        assumed = self._assumed.get(key)
        if assumed is not None:
            phase = (pod.get("status") or {}).get("phase")
            if deleted or phase in TERMINAL_PHASES or deletion_final(
                    pod.get("metadata") or {}) or assumed.uid != hold_uid(pod) or (
                    hold is not None and hold.node == assumed.node):
                del self._assumed[key]  # gone, replaced, or confirmed by the watch
        return key

    def gang_created(self, namespace: str, owner: Owner) -> int:
        """The newest attempt of the gang `owner` names whose worker pods all exist, as the
        operator records it (status.gangCreated); 0: none, or not this job."""
        with self._lock:
            known = self._jobs.get(f"{namespace}/{owner.name}")
            created = self._gang_created.get(f"{namespace}/{owner.name}", 0)
        return created if known is not None and known[0] == owner.uid else 0

    def apply_pod(self, event: str, pod: Mapping[str, Any], now: float) -> None:
        with self._lock:
            self.events["pods"] += 1
            self._refresh(self._observe(pod, event == "DELETED", now))

    def replace_pods(self, pods: Iterable[Mapping[str, Any]], now: float) -> None:
        """A relist: the listed pods are the truth; assumptions stay until confirmed."""
        with self._lock:
            keys = set(self._observed) | set(self._observed_usage)
            self._observed = {}
            self._observed_usage = {}
            for pod in pods:
                keys.add(self._observe(pod, False, now))
            for key in keys | set(self._assumed):
                self._refresh(key)

    def forget(self, pod_key: str, uid: str) -> None:
        """Drop an assumption (the bind failed)."""
        with self._lock:
            hold = self._assumed.get(pod_key)
            if hold is not None and hold.uid == uid:
                del self._assumed[pod_key]
                self._refresh(pod_key)

    def expire_assumed(self, now: float) -> list[str]:
        """Drop assumptions the (healthy) watch never confirmed within ASSUMED_TTL_S.

        Every bind calls this; it looks through the assumptions at most once a second
        (there are thousands when the API server falls behind, and the TTL is minutes).
        """
        if not self.pods_watch_healthy or now - self._expiry_checked < 1.0:
            return []
        self._expiry_checked = now
        with self._lock:
            old = [k for k, h in self._assumed.items() if now - h.assigned_at > ASSUMED_TTL_S]
            for key in old:
                del self._assumed[key]
                self._refresh(key)
            return old

    # --- reads ---------------------------------------------------------------------------

    def _state(self, node: str) -> NodeState | None:
        state = self._states.get(node)
        if state is None:
            inventory = self._inventories.get(node)
            if inventory is None:
                return None
            grants = self._grants_on(node, sorted(self._keys_on_node.get(node, ())))
            cpu, memory = self._node_usage.get(node, (0, 0))
            state = self._states[node] = CachedState(inventory, grants, cpu, memory)
        return state

    def _without(self, state: NodeState, node: str, exclude_key: str) -> NodeState:
        rest = sorted(self._keys_on_node.get(node, set()) - {exclude_key})
        cpu, memory = state.cpu_used_milli, state.memory_used_mib
        own = self._usage.get(exclude_key)
        if own is not None and own[0] == node:
            cpu, memory = cpu - own[1], memory - own[2]
        return CachedState(state.inventory, self._grants_on(node, rest), cpu, memory)

    def _grants_on(self, node: str, keys: Iterable[str]) -> tuple[GpuGrant, ...]:
        """The grants of these pods' holds; with lending, each owner's split by its peak
        (its lent part marked `lent`). The operator waits `observed_s` before it lends (or
        keeps at least the template's calibrated size until then); the extender trusts a
        peak at once, so its lent parts hold at least the operator's."""
        if self.lending is None:
            return tuple(g for k in keys for g in self._effective[k].grants)
        peaks = self._peaks.get(node, {})
        out: list[GpuGrant] = []
        for key in keys:
            for grant in self._effective[key].grants:
                peak = peaks.get((key, grant.gpu_uuid))
                memory, _ = lendable(grant, peak, None, math.inf, self.lending)
                out.extend(split((grant,), memory, 0))
        return tuple(out)

    def _in_flight(self, node: str, exclude_key: str, now: float) -> tuple[Hold, ...]:
        return tuple(h for k in sorted(self._keys_on_node.get(node, ()))
                     if k != exclude_key and (h := self._effective[k]).in_flight(now))

    def snapshot(self, nodes: Iterable[str], exclude_key: str, now: float) -> Snapshot:
        """The asked-for nodes' states for one pod; cheap for nodes that have not changed."""
        states: dict[str, NodeState] = {}
        missing: dict[str, str] = {}
        in_flight: dict[str, tuple[Hold, ...]] = {}
        with self._lock:
            memo = self._states
            for name in nodes:
                state = memo.get(name) or self._state(name)
                if state is None:
                    missing[name] = self._broken.get(name, UNKNOWN_NODE)
                else:
                    states[name] = state
            own = self._effective.get(exclude_key)
            if own is not None and own.node in states:
                states[own.node] = self._without(states[own.node], own.node, exclude_key)
            in_flight = self._in_flight_on(self._unsettled.keys() & states.keys(), exclude_key,
                                           now)
        return Snapshot(states, missing, in_flight)

    def _in_flight_on(self, nodes: Iterable[str], exclude_key: str, now: float
                      ) -> dict[str, tuple[Hold, ...]]:
        """Other pods' in-flight holds on these nodes (with unsettled holds); holds past the
        staleness timeout are settled on the way."""
        in_flight: dict[str, tuple[Hold, ...]] = {}
        stale = []
        for node in nodes:
            for key in sorted(self._unsettled[node]):
                hold = self._effective[key]
                if not hold.in_flight(now):
                    stale.append((node, key))
                elif key != exclude_key:
                    in_flight[node] = (*in_flight.get(node, ()), hold)
        for node, key in stale:
            self._settled(node, key)
        return in_flight

    def pod_view(self, pod_key: str, now: float) -> PodView:
        """`snapshot`'s in-flight holds and the pod's own node (its state without the pod's
        hold) over every node, without a state per node: the search over the node index
        (`ranking.NodeIndex`) reads the other nodes' states from `changes_since`."""
        with self._lock:
            in_flight = self._in_flight_on(list(self._unsettled), pod_key, now)
            hold = self._effective.get(pod_key)
            state = self._state(hold.node) if hold is not None else None
            own = None
            if hold is not None and state is not None:
                own = (hold.node, self._without(state, hold.node, pod_key))
        return PodView(in_flight, own)

    def changes_since(self, position: int | None
                      ) -> tuple[dict[str, NodeState | None], int, bool]:
        """The current state (None: gone) of each node changed since `position`, the position
        to ask from next time, and whether the answer is every known node instead (asked
        with None, or from a position the change log no longer reaches)."""
        with self._lock:
            end = self._log_start + len(self._log)
            if position is None or position < self._log_start:
                return ({name: self._state(name) for name in self._inventories}, end, True)
            names = dict.fromkeys(self._log[position - self._log_start:])
            return ({name: self._state(name) for name in names}, end, False)

    def state_of(self, node: str) -> NodeState | None:
        """The node's current state (None if unknown)."""
        with self._lock:
            return self._state(node)

    def drain_changed(self) -> set[str]:
        """Nodes whose state changed since the last call (the ranker's warmer re-evaluates
        them)."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed

    def supply(self) -> dict[str, int]:
        """GPUs per model over the known nodes (healthy or not: it moves only with nodes)."""
        with self._lock:
            return {model: n for model, n in self._supply.items() if n > 0}

    def usage_of(self, node: str) -> tuple[int, int]:
        """CPU milli and memory MiB requested by the pods on (or assumed onto) the node."""
        with self._lock:
            return self._node_usage.get(node, (0, 0))

    def hold_of(self, pod_key: str) -> Hold | None:
        with self._lock:
            return self._effective.get(pod_key)

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._inventories)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"nodes": len(self._inventories), "holds": len(self._effective),
                    "assumed": len(self._assumed)}

    # --- the one write a bind makes ------------------------------------------------------

    def reserve(self, pod_key: str, uid: str, node: str, gpu_counts: frozenset[int],
                now: float, choose: Chooser, cpu_milli: int = 0,
                memory_mib: int = 0) -> Assignment | Refused | InFlightClash:
        """Choose GPUs on `node` and assume them, atomically; why not if it can't.

        `choose` runs under the lock on the node's current state (this pod's own holds left
        out); it must be quick and pure.
        """
        with self._lock:
            state = self._state(node)
            if state is None:
                return Refused(f"{node}: {self._broken.get(node, UNKNOWN_NODE)}")
            if pod_key in self._keys_on_node.get(node, ()):
                state = self._without(state, node, pod_key)
            clash = in_flight_clash(self._in_flight(node, pod_key, now), gpu_counts)
            if clash is not None:
                return InFlightClash(clash)
            chosen = choose(state)
            if isinstance(chosen, Refused):
                return chosen
            assignment, grants = chosen
            self._assumed[pod_key] = Hold(pod_key, uid, node, grants, gpu_counts, now,
                                          assumed=True, cpu_milli=cpu_milli,
                                          memory_mib=memory_mib)
            self._refresh(pod_key)
            return assignment

    def settle(self, pod_key: str) -> None:
        """Mark an assumed hold as no longer in flight (tests and simulations)."""
        with self._lock:
            hold = self._assumed.get(pod_key)
            if hold is not None:
                self._assumed[pod_key] = replace(hold, settled=True)
                self._refresh(pod_key)


def _usage_of(pod: Mapping[str, Any]) -> tuple[str, int, int] | None:
    """(node, CPU milli, memory MiB) a bound, unfinished pod requests; None otherwise."""
    spec = pod.get("spec") or {}
    node = spec.get("nodeName") if isinstance(spec, Mapping) else None
    if not node or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES \
            or deletion_final(pod.get("metadata") or {}):
        return None
    cpu, memory = pod_requests(spec)
    return str(node), cpu, memory


def hold_uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


HOLDING_PHASES = frozenset(p.value for p in Phase if p.holds_gpus)


def worker_reservations(job: Mapping[str, Any], request: GpuRequest | str
                        ) -> dict[str, Hold]:
    """The holds a gang's workers keep on the GPUs its admission chose (by worker pod key):
    what the operator wrote in status.workers while the job holds GPUs (Admitted, or Running
    once rank 0 runs); none for any other job or phase. A worker's bound pod holds the same
    GPUs through its own assignment, which takes precedence."""
    status = job.get("status") or {}
    if status.get("phase") not in HOLDING_PHASES or not status.get("workers"):
        return {}
    namespace = str((job.get("metadata") or {}).get("namespace", ""))
    exclusive = isinstance(request, GpuRequest) and request.isolation is Isolation.EXCLUSIVE
    try:
        entries = sorted((e for e in status["workers"] if isinstance(e, Mapping)),
                         key=lambda e: int(e.get("rank", 0)))
        placements = placements_from_status(status, exclusive)
    except (TypeError, ValueError):  # not what the operator writes: reserve nothing
        return {}
    out = {}
    for entry, placement in zip(entries, placements, strict=True):
        pod = f"{namespace}/{entry.get('pod', '')}"
        if placement.node and placement.grants:
            out[pod] = Hold(pod, "", placement.node, placement.grants,
                            frozenset({len(placement.grants)}), 0.0, settled=True)
    return out


def in_flight_clash(in_flight: Iterable[Hold], gpu_counts: frozenset[int]) -> str | None:
    """The handshake rule: no two in-flight pods on a node with the same per-container count."""
    for hold in in_flight:
        if hold.gpu_counts & gpu_counts:
            state = "assumed" if hold.assumed else "bound"
            return (f"allocation in flight on this node ({hold.pod_key}, {state}); "
                    "retry shortly")
    return None


def gang_attempt(pod: Mapping[str, Any]) -> int | None:
    """The attempt a gang's worker pod belongs to (the operator's `carpool.dev/gang`,
    "<attempt>/<workers>"); None for any other pod or an unreadable value."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    gang = annotations.get(names.ANN_GANG) if isinstance(annotations, Mapping) else None
    attempt = gang.partition("/")[0] if isinstance(gang, str) else ""
    return int(attempt) if attempt.isdigit() else None
