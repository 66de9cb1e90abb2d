"""The kube-scheduler extender wire format, decoded into core types and encoded back.

The extender structs (`ExtenderArgs`, `ExtenderFilterResult`, `HostPriority`,
`ExtenderBindingArgs`, `ExtenderBindingResult`) have no JSON tags in Go, so their keys are the
Go field names; the Pod and Node inside them are ordinary Kubernetes JSON. Everything a handler
needs is decoded here, once, and anything malformed raises `WireError` with a message that
says what was wrong, which the server turns into HTTP 400. (The `carpool.dev/assignment`
annotation has its one codec in `carpool.core.assignment`.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

import orjson

from carpool.core import names
from carpool.core.assignment import Assignment, AssignmentError, parse_assignment
from carpool.core.ownership import Owner, gpujob_owner
from carpool.core.quantities import quantity_mib, quantity_milli
from carpool.core.resources import GpuRequest, Isolation

MIB_PER_GIB = 1024
MAX_NODE_NAMES = 100_000


class WireError(ValueError):
    """Input the extender cannot act on; the message is returned to the caller as is."""


class Policy:
    """Placement policy names accepted globally and per job (annotation)."""

    BINPACK = "binpack"
    SPREAD = "spread"
    ALL = (BINPACK, SPREAD)


@dataclass(frozen=True)
class ContainerDemand:
    """One container's GPU request (count GPUs, each with this memory and compute)."""

    container: str
    request: GpuRequest


@dataclass(frozen=True)
class PodDemand:
    """What a pod asks of Carpool, decoded from its resources and annotations."""

    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerDemand, ...]
    dataset: str = ""
    dataset_size_gib: float = 0.0
    policy: str | None = None  # per-job override of the extender's policy
    cpu_milli: int = 0  # the pod's CPU request (see `pod_requests`)
    memory_mib: int = 0  # the pod's memory request
    owner: Owner | None = None  # the GpuJob controlling the pod (core.ownership)
    # the node and GPUs the operator's admission chose (names.ANN_PLANNED; None: none, or
    # not readable)
    planned: Assignment | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def gpu_counts(self) -> frozenset[int]:
        """Per-container GPU counts: what the in-flight handshake rule compares."""
        return frozenset(c.request.count for c in self.containers)


@dataclass(frozen=True)
class ExtenderArgs:
    """A filter or prioritize call: the pod and the candidate node names."""

    pod: Mapping[str, Any]
    node_names: tuple[str, ...]
    nodes_by_name: Mapping[str, Any] | None  # full Node objects when not nodeCacheCapable


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @property
    def key(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}"


# --- JSON helpers -------------------------------------------------------------------------


def parse_json(body: bytes) -> Any:
    """orjson: a filter body names every candidate node, and the standard library's parser
    took a noticeable share of a request at 1,213 nodes."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # orjson stops at 1,024 levels
            raise WireError("request body is nested too deeply") from None
        raise WireError(f"request body is not valid JSON: {exc}") from None


def dump_json(value: Any) -> bytes:
    """Compact JSON (orjson: a prioritize answer is 1,213 objects at the openb scale)."""
    return orjson.dumps(value)


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise WireError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _string(value: object, what: str, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise WireError(f"{what} must be a non-empty string")
    return value


# --- requests -----------------------------------------------------------------------------


def _node_names(raw: object) -> tuple[str, ...]:
    # (one pass in C: this list names every candidate node)
    if not isinstance(raw, list) or not set(map(type, raw)) <= {str}:
        raise WireError("ExtenderArgs.NodeNames must be a list of strings")
    return tuple(raw)


def decode_extender_args(body: object, node_names: tuple[str, ...] | None = None
                         ) -> ExtenderArgs:
    """`ExtenderArgs {Pod, Nodes, NodeNames}`; NodeNames when nodeCacheCapable, else Nodes.
    `node_names`: NodeNames decoded already (`ArgsReader`)."""
    args = _mapping(body, "ExtenderArgs")
    pod = _mapping(args.get("Pod"), "ExtenderArgs.Pod")
    raw_names = args.get("NodeNames")
    nodes_by_name: dict[str, Any] | None = None
    if node_names is not None:
        pass
    elif raw_names is not None:
        node_names = _node_names(raw_names)
    else:
        nodes = args.get("Nodes")
        if nodes is None:
            raise WireError("ExtenderArgs needs NodeNames or Nodes")
        items = _mapping(nodes, "ExtenderArgs.Nodes").get("items") or []
        if not isinstance(items, list):
            raise WireError("ExtenderArgs.Nodes.items must be a list")
        nodes_by_name = {}
        for item in items:
            meta = _mapping(_mapping(item, "node").get("metadata"), "node.metadata")
            nodes_by_name[_string(meta.get("name"), "node.metadata.name")] = item
        node_names = tuple(nodes_by_name)
    if len(node_names) > MAX_NODE_NAMES:
        raise WireError(f"too many nodes ({len(node_names)}); limit {MAX_NODE_NAMES}")
    return ExtenderArgs(pod, node_names, nodes_by_name)


NAMES_KEY = b'"NodeNames":'


class ArgsReader:
    """`decode_extender_args` of a request body, with the node names of the last body kept.

    kube-scheduler names the candidate nodes in every filter call (thousands of names), often
    the same list as the call before, and parsing them was a good share of a request. Go
    writes `NodeNames` as the body's last member, so its bytes are cut out and compared with
    the last body's; only a new list is parsed. A body written otherwise (spaces, Nodes) is
    parsed whole. For one thread (the server's event loop).
    """

    def __init__(self) -> None:
        self._last: tuple[bytes, tuple[str, ...]] = (b"", ())

    def read(self, body: bytes) -> ExtenderArgs:
        start = body.rfind(NAMES_KEY + b"[")
        # node names are DNS subdomains: the first "]" ends the list (else it is not a
        # list of names, and parsing the part up to it fails)
        end = body.find(b"]", start) if start >= 0 else -1
        if end < 0:
            return decode_extender_args(parse_json(body))
        listed = body[start + len(NAMES_KEY):end + 1]
        known, names = self._last
        if listed != known:
            try:
                names = _node_names(orjson.loads(listed))
            except orjson.JSONDecodeError:
                return decode_extender_args(parse_json(body))
            self._last = (listed, names)
        rest = parse_json(body[:start + len(NAMES_KEY)] + b"null" + body[end + 1:])
        return decode_extender_args(rest, names)


def decode_binding_args(body: object) -> BindingArgs:
    """`ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}`."""
    args = _mapping(body, "ExtenderBindingArgs")
    return BindingArgs(
        pod_name=_string(args.get("PodName"), "ExtenderBindingArgs.PodName"),
        pod_namespace=_string(args.get("PodNamespace"), "ExtenderBindingArgs.PodNamespace"),
        pod_uid=_string(args.get("PodUID"), "ExtenderBindingArgs.PodUID", required=False),
        node=_string(args.get("Node"), "ExtenderBindingArgs.Node"),
    )


# --- pods ---------------------------------------------------------------------------------


def _quantity(value: object, what: str) -> int:
    """A whole-number Kubernetes quantity ("2", "8", "1k"); extended resources are integers."""
    number = _whole_number(str(value).strip())
    if isinstance(number, str):
        raise WireError(f"{what}: {value!r} {number}")
    return number


@lru_cache(maxsize=4096)
def _whole_number(text: str) -> int | str:
    """`_quantity`'s value of a text, or what is wrong with it. Every filter and bind reads
    its pod's GPU resources, from a few distinct texts: each is parsed once."""
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
                "G": 10**9, "T": 10**12}
    multiplier = 1
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            text, multiplier = text[: -len(suffix)], factor
            break
    try:
        number = Decimal(text) * multiplier
    except InvalidOperation:
        return "is not a quantity"
    if not number.is_finite() or number != number.to_integral_value() or number < 0:
        return "must be a non-negative whole number"
    if number > 10**9:
        return "is implausibly large"
    return int(number)


def _container_request(container: Mapping[str, Any], isolation: Isolation,
                       models: frozenset[str]) -> ContainerDemand | None:
    name = str(container.get("name") or "")
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise WireError(f"container {name!r}: resources must be an object")
    amounts: dict[str, object] = {}
    for section in ("requests", "limits"):  # limits win: extended resources need limits
        values = resources.get(section) or {}
        if not isinstance(values, Mapping):
            raise WireError(f"container {name!r}: resources.{section} must be an object")
        amounts.update(values)
    if names.RESOURCE_GPU not in amounts:
        return None
    where = f"container {name!r} {names.RESOURCE_GPU}"
    count = _quantity(amounts[names.RESOURCE_GPU], where)
    if count == 0:
        return None
    memory_gib = _quantity(amounts.get(names.RESOURCE_GPU_MEMORY, 0),
                           f"container {name!r} {names.RESOURCE_GPU_MEMORY}")
    cores = _quantity(amounts.get(names.RESOURCE_GPU_CORES, 0),
                      f"container {name!r} {names.RESOURCE_GPU_CORES}")
    try:
        request = GpuRequest(count=count, memory_mib=memory_gib * MIB_PER_GIB, cores_pct=cores,
                             isolation=isolation, models=models)
    except ValueError as exc:
        raise WireError(f"container {name!r}: {exc}") from None
    return ContainerDemand(name, request)


def _requested(container: object, resource: str, parse: Callable[[str], int]) -> int:
    if not isinstance(container, Mapping):
        return 0
    resources = container.get("resources")
    requests = resources.get("requests") if isinstance(resources, Mapping) else None
    value = requests.get(resource) if isinstance(requests, Mapping) else None
    if value is None:
        return 0
    try:
        return max(0, parse(str(value)))
    except (ValueError, ArithmeticError):
        return 0  # the API server validates quantities; scoring just does without


def pod_requests(spec: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's effective CPU (milli) and memory (MiB) requests, as kube-scheduler counts
    them: the sum over containers, or the largest init container if that is more, plus
    the pod overhead. Unreadable values count as 0 (these only inform scoring)."""
    out = []
    for resource, parse in (("cpu", quantity_milli), ("memory", quantity_mib)):
        containers = spec.get("containers")
        inits = spec.get("initContainers")
        total = sum(_requested(c, resource, parse)
                    for c in (containers if isinstance(containers, list) else ()))
        init = max((_requested(c, resource, parse)
                    for c in (inits if isinstance(inits, list) else ())), default=0)
        overhead = _requested({"resources": {"requests": spec.get("overhead")}}, resource, parse)
        out.append(max(total, init) + overhead)
    return out[0], out[1]


def decode_pod(pod: Mapping[str, Any]) -> PodDemand:
    """A pod's Carpool demand from its container resources and `carpool.dev/*` annotations."""
    meta = _mapping(pod.get("metadata"), "Pod.metadata")
    spec = _mapping(pod.get("spec"), "Pod.spec")
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        raise WireError("Pod.metadata.annotations must be an object")
    try:
        isolation = Isolation.parse(str(annotations.get(names.ANN_ISOLATION) or "mps"))
    except ValueError as exc:
        raise WireError(f"annotation {names.ANN_ISOLATION}: {exc}") from None
    models = frozenset(m.strip() for m in str(annotations.get(names.ANN_MODELS) or "").split(",")
                       if m.strip())
    policy = annotations.get(names.ANN_POLICY) or None
    if policy is not None and policy not in Policy.ALL:
        raise WireError(f"annotation {names.ANN_POLICY}: {policy!r} is not one of "
                        f"{', '.join(Policy.ALL)}")
    size_text = annotations.get(names.ANN_DATASET_SIZE) or "0"
    try:
        dataset_size = float(size_text)
    except (TypeError, ValueError):
        raise WireError(f"annotation {names.ANN_DATASET_SIZE}: {size_text!r} is not a number"
                        ) from None
    if not 0 <= dataset_size < float("inf"):
        raise WireError(f"annotation {names.ANN_DATASET_SIZE} must be a finite number >= 0")
    containers_raw = spec.get("containers") or []
    if not isinstance(containers_raw, list):
        raise WireError("Pod.spec.containers must be a list")
    containers = []
    for raw in containers_raw:
        demand = _container_request(_mapping(raw, "container"), isolation, models)
        if demand is not None:
            containers.append(demand)
    cpu_milli, memory_mib = pod_requests(spec) if containers else (0, 0)
    return PodDemand(
        namespace=_string(meta.get("namespace") or "default", "Pod.metadata.namespace"),
        name=_string(meta.get("name"), "Pod.metadata.name"),
        uid=str(meta.get("uid") or ""),
        containers=tuple(containers),
        dataset=str(annotations.get(names.ANN_DATASET) or ""),
        dataset_size_gib=dataset_size,
        policy=policy,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        owner=gpujob_owner(_owner_references(meta)),
        planned=_planned(annotations.get(names.ANN_PLANNED)),
    )


def _planned(text: object) -> Assignment | None:
    if not text:
        return None
    try:
        return parse_assignment(str(text))
    except AssignmentError:
        return None


def _owner_references(meta: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    refs = meta.get("ownerReferences") or []
    if not isinstance(refs, list):
        raise WireError("Pod.metadata.ownerReferences must be a list")
    return [r for r in refs if isinstance(r, Mapping)]


# --- responses ----------------------------------------------------------------------------


def encode_filter_result(args: ExtenderArgs, passed: Sequence[str],
                         failed: Mapping[str, str], unresolvable: Mapping[str, str],
                         error: str = "") -> dict[str, Any]:
    """`ExtenderFilterResult`; echoes Nodes back when the scheduler sent Nodes."""
    result: dict[str, Any] = {
        "NodeNames": list(passed),
        "FailedNodes": dict(failed),
        "FailedAndUnresolvableNodes": dict(unresolvable),
        "Error": error,
    }
    if args.nodes_by_name is not None:
        result["Nodes"] = {"items": [args.nodes_by_name[n] for n in passed]}
        result["NodeNames"] = None
    return result


def encode_priorities(scores: Mapping[str, int]) -> list[dict[str, Any]]:
    """`HostPriorityList`, in the order given."""
    return [{"Host": host, "Score": score} for host, score in scores.items()]
