"""The `carpool.dev/assignment` annotation: which GPUs a pod holds on which node.

The extender writes it at bind, the device plugin hands exactly those GPUs to the container,
the operator accounts them, `kubectl carpool` and the chaos checks show them. This module is
the one codec for all of them: `encode_assignment` writes what the extender records, and
`parse_assignment` accepts exactly that shape, refusing anything else with an
`AssignmentError` that names the field (annotations are user-writable text).

    {"node": "gpu-1", "isolation": "mps",
     "gpus": [{"uuid": "GPU-…", "index": 0, "memoryMiB": 20480, "cores": 25,
               "migInstance": "MIG-…", "container": "main", "sharingLimit": 2}]}

`isolation` is the sharing mode the extender placed the pod for, taken from its GpuJob's
spec (immutable), so the device plugin, the operator and the reports read it from what
Carpool wrote rather than from the pod's own annotations; it is left out of assignments made
before it was recorded (readers then fall back to the node's mode). `migInstance`,
`container` and `sharingLimit` (the most jobs the pod's job lets its GPU carry, counted by
weight, to the hundredth: `core.interference`) are left out when empty, `sharingWeight` (how
heavy a sharer the job is, thousandths) when whole (1000); so are `sharingTemplate` (the job's
template, where a measured pair may concern it) and `sharingPairs` (for each template measured
beside it, the copies of a job of that template the holder counts as to it: `Sharer.felt_by`);
`cores` defaults to 0; keys this version does not know are ignored (a newer extender may add
some).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from carpool.core.annotations import load_annotation_json
from carpool.core.names import ANN_ASSIGNMENT
from carpool.core.resources import MAX_DEGREE, MAX_PAIRS, WHOLE_SHARER, FeltBy, GpuGrant, Isolation

# How long a bound pod counts as "in flight" (assigned, not yet handed over by the device
# plugin, not running) when nothing else ends it. The extender keeps a second pod with the same
# GPU count off a node while one is in flight, because Allocate carries no pod identity and the
# plugin tells such pods apart by count alone. A bound pod always leaves that state (the kubelet
# admits it, fails it, or it is deleted, e.g. when its node dies); the timeout is only a last
# resort, so it is long: a short one (60 s) let a second pod onto a node whose kubelet was slow
# to admit the first, and the plugin then handed the two each other's GPUs. The plugin uses the
# same value to rank a stale candidate last.
HAND_OVER_STALE_S = 600.0
MAX_TEMPLATE_CHARS = 512  # a job template's name (`jobs.job_template`: its name's stem and image)


class AssignmentError(ValueError):
    """A `carpool.dev/assignment` value that is not what the extender writes."""


@dataclass(frozen=True)
class AssignedGpu:
    """One GPU a container holds, as the extender recorded it at bind."""

    uuid: str
    index: int
    memory_mib: int
    cores_pct: int
    mig_instance: str = ""
    container: str = ""
    sharing_limit: float = 0  # the most jobs the holder lets this GPU carry (0: no limit)
    sharing_weight: int = WHOLE_SHARER  # how heavy a sharer the holder is (core.interference)
    borrowed: bool = False  # in capacity another job lent (core.lending)
    sharing_template: str = ""  # the holder's template and the pairs learned about it
    sharing_pairs: FeltBy = ()  # (`resources.Sharer`)

    @classmethod
    def of(cls, grant: GpuGrant, index: int, container: str = "") -> AssignedGpu:
        """The entry recording `grant` on the GPU of `index`."""
        return cls(grant.gpu_uuid, index, grant.memory_mib, grant.cores_pct,
                   grant.mig_instance, container, grant.sharing_limit, grant.sharing_weight,
                   grant.borrowed, grant.sharing_template, grant.sharing_felt_by)


@dataclass(frozen=True)
class Assignment:
    """The whole annotation: the node and every GPU of every container."""

    node: str
    gpus: tuple[AssignedGpu, ...]
    isolation: Isolation | None = None  # None: not recorded (an older extender)

    def grants(self, exclusive: bool = False,
               memory_total: Mapping[str, int] | None = None) -> tuple[GpuGrant, ...]:
        """The grants this assignment holds: `exclusive` (or the recorded isolation) makes
        every grant hold its whole GPU, with the GPU's total memory where `memory_total`
        knows it. A recorded MPS isolation wins over `exclusive`: a whole-GPU job placed as
        an MPS share of its calibrated size (`right_sizing.shared_whole_gpu`) holds that."""
        totals = memory_total or {}
        if (self.isolation is Isolation.EXCLUSIVE
                or (exclusive and self.isolation is not Isolation.MPS)):
            return tuple(GpuGrant(g.uuid, totals.get(g.uuid, g.memory_mib), 100, exclusive=True)
                         for g in self.gpus)
        return tuple(GpuGrant(g.uuid, g.memory_mib, g.cores_pct, mig_instance=g.mig_instance,
                              sharing_limit=g.sharing_limit, sharing_weight=g.sharing_weight,
                              sharing_template=g.sharing_template,
                              sharing_felt_by=g.sharing_pairs, borrowed=g.borrowed)
                     for g in self.gpus)


def encode_assignment(assignment: Assignment) -> str:
    """The annotation's text (compact JSON)."""
    data: dict[str, object] = {"node": assignment.node}
    if assignment.isolation is not None:
        data["isolation"] = assignment.isolation.value
    data["gpus"] = [gpu_entry(g) for g in assignment.gpus]
    return json.dumps(data, separators=(",", ":"))


def gpu_entry(gpu: AssignedGpu) -> dict[str, object]:
    """One GPU as the annotation (and a GpuJob's `status.gpus`) writes it."""
    entry: dict[str, object] = {"uuid": gpu.uuid, "index": gpu.index,
                                "memoryMiB": gpu.memory_mib, "cores": gpu.cores_pct}
    if gpu.mig_instance:
        entry["migInstance"] = gpu.mig_instance
    if gpu.container:
        entry["container"] = gpu.container
    if gpu.sharing_limit:
        entry["sharingLimit"] = gpu.sharing_limit
    if gpu.sharing_weight != WHOLE_SHARER:
        entry["sharingWeight"] = gpu.sharing_weight
    if gpu.borrowed:
        entry["borrowed"] = True
    if gpu.sharing_template:
        entry["sharingTemplate"] = gpu.sharing_template
    if gpu.sharing_pairs:
        entry["sharingPairs"] = dict(gpu.sharing_pairs)
    return entry


def parse_assignment(text: str) -> Assignment:
    """The annotation's content; AssignmentError naming the field when it is malformed."""
    try:
        data = load_annotation_json(text, ANN_ASSIGNMENT)
    except ValueError as err:
        raise AssignmentError(str(err)) from None
    if not isinstance(data, dict):
        raise AssignmentError(f"{ANN_ASSIGNMENT} must be a JSON object, "
                              f"got {type(data).__name__}")
    node = data.get("node")
    if not isinstance(node, str) or not node:
        raise AssignmentError(f"{ANN_ASSIGNMENT}: node must be a non-empty string, got {node!r}")
    isolation = None
    if (raw := data.get("isolation")) is not None:
        try:
            isolation = Isolation.parse(str(raw)) if isinstance(raw, str) else None
        except ValueError:
            isolation = None
        if isolation is None:
            raise AssignmentError(f"{ANN_ASSIGNMENT}: isolation must be one of "
                                  f"{', '.join(i.value for i in Isolation)}, got {raw!r}")
    return Assignment(node, parse_gpus(data.get("gpus"), ANN_ASSIGNMENT), isolation)


def parse_gpus(raw: object, where: str) -> tuple[AssignedGpu, ...]:
    """A non-empty list of GPU entries (see the module docstring); AssignmentError naming
    `where` and the entry when it is malformed."""
    if not isinstance(raw, list) or not raw:
        raise AssignmentError(f"{where}: gpus must be a non-empty list")
    return tuple(_gpu(entry, f"{where} gpus[{n}]") for n, entry in enumerate(raw))


def _gpu(raw: object, where: str) -> AssignedGpu:
    if not isinstance(raw, dict):
        raise AssignmentError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    uuid = raw.get("uuid")
    if not isinstance(uuid, str) or not uuid:
        raise AssignmentError(f"{where}: uuid must be a non-empty string, got {uuid!r}")
    return AssignedGpu(uuid=uuid, index=_count(raw, "index", where),
                       memory_mib=_count(raw, "memoryMiB", where),
                       cores_pct=_count(raw, "cores", where, 0),
                       mig_instance=_text(raw, "migInstance", where),
                       container=_text(raw, "container", where),
                       sharing_limit=_limit(raw, where),
                       sharing_weight=_weight(raw, where),
                       borrowed=_flag(raw, "borrowed", where),
                       sharing_template=_template(raw.get("sharingTemplate", ""),
                                                  f"{where}: sharingTemplate"),
                       sharing_pairs=_pairs(raw, where))


def _limit(raw: Mapping[str, object], where: str) -> float:
    value = raw.get("sharingLimit", 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e6:
        raise AssignmentError(f"{where}: sharingLimit must be a non-negative number, "
                              f"got {value!r}")
    return value


def _template(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEMPLATE_CHARS:
        raise AssignmentError(f"{where} must be a string of at most {MAX_TEMPLATE_CHARS} "
                              f"characters, got {value!r:.80}")
    return value


def _pairs(raw: Mapping[str, object], where: str) -> FeltBy:
    value = raw.get("sharingPairs", {})
    if not isinstance(value, dict) or len(value) > MAX_PAIRS:
        raise AssignmentError(f"{where}: sharingPairs must be an object of at most {MAX_PAIRS} "
                              f"templates, got {value!r:.80}")
    pairs = []
    for template, count in sorted(value.items()):
        name = _template(template, f"{where}: sharingPairs key")
        if not name or isinstance(count, bool) or not isinstance(count, int | float) \
                or not 0 < count <= MAX_DEGREE:
            raise AssignmentError(f"{where}: sharingPairs[{name!r:.80}] must be a number of "
                                  f"copies above 0 and at most {MAX_DEGREE}, got {count!r}")
        pairs.append((name, float(count)))
    return tuple(pairs)


def _weight(raw: Mapping[str, object], where: str) -> int:
    value = _count(raw, "sharingWeight", where, WHOLE_SHARER)
    if not 1 <= value <= WHOLE_SHARER:
        raise AssignmentError(f"{where}: sharingWeight must be between 1 and {WHOLE_SHARER}, "
                              f"got {value}")
    return value


def _count(raw: Mapping[str, object], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AssignmentError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    return value


def _flag(raw: Mapping[str, object], key: str, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise AssignmentError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _text(raw: Mapping[str, object], key: str, where: str) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str):
        raise AssignmentError(f"{where}: {key} must be a string, got {value!r}")
    return value
