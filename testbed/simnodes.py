"""Simulated GPU nodes: KWOK Nodes with Carpool GPU capacity, plus their `GpuNode` objects.

A simulated node's `GpuNode` status is built by the device plugin's fake backend and its
telemetry builder — the code path that publishes NVML readings on a real node — so the
extender and the operator see a simulated node exactly as they would see a real one.

Nodes come from a small YAML file (see `examples/nodes.yaml`) or from the openb trace's node
list. Applying is idempotent (server-side apply); deleting removes both objects.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from carpool.core.gpunode import GPU_MODEL_MEMORY_MIB, SHARING_MODES
from carpool.core.names import (
    API_VERSION,
    GROUP,
    LABEL_SHARING,
    LABEL_ZONE,
    RESOURCE_GPU,
)
from carpool.core.quantities import parse_quantity, quantity_mib, quantity_milli
from carpool.core.timestamps import format_timestamp
from carpool.deviceplugin.backends.fake import DEFAULT_CUDA, DEFAULT_DRIVER, FakeBackend
from carpool.deviceplugin.devices import share_count
from carpool.deviceplugin.telemetry import status_from_backend

LABEL_SIMULATED = f"{GROUP}/simulated"  # "true" on every Node and GpuNode made here
LABEL_GPU_MODEL = f"{GROUP}/gpu-model"  # the node's GPU model ("mixed" if it has several)
LABEL_GPU_COUNT = f"{GROUP}/gpu-count"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"  # KWOK manages nodes annotated with "fake"
FIELD_MANAGER = "carpool-simnodes"

DEFAULT_SHARES_PER_GPU = 8
DEFAULT_CPU_MILLI = 32_000
DEFAULT_MEMORY_MIB = 256 * 1024
DEFAULT_MAX_PODS = 110
OPENB_ZONES = ("zone-a", "zone-b", "zone-c")

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class SimMig:
    """An existing MIG instance on a simulated GPU."""

    profile: str
    slices: int
    memory_mib: int


@dataclass(frozen=True)
class Taint:
    """A Node taint, e.g. to keep one test's pods apart from another's."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def manifest(self) -> dict[str, str]:
        out = {"key": self.key, "effect": self.effect}
        if self.value:
            out["value"] = self.value
        return out


@dataclass(frozen=True)
class SimGpuGroup:
    """`count` identical GPUs of one node (one `gpus` entry of the YAML)."""

    model: str
    count: int = 1
    memory_total_mib: int | None = None  # None: from carpool.core.gpunode's model table
    temperature_c: float = 40.0
    slowdown_temperature_c: float | None = None  # None: the model's NVML slowdown threshold
    power_w: float = 60.0
    mig_instances: tuple[SimMig, ...] = ()


@dataclass(frozen=True)
class SimNode:
    """One simulated GPU node: what the Node advertises and what its GPUs report."""

    name: str
    gpus: tuple[SimGpuGroup, ...]
    zone: str = ""
    sharing: str = "mps"
    cpu_milli: int = DEFAULT_CPU_MILLI
    memory_mib: int = DEFAULT_MEMORY_MIB
    max_pods: int = DEFAULT_MAX_PODS
    shares_per_gpu: int = DEFAULT_SHARES_PER_GPU
    datasets: tuple[str, ...] = ()
    driver_version: str = DEFAULT_DRIVER
    cuda_version: str = DEFAULT_CUDA
    labels: tuple[tuple[str, str], ...] = field(default=())
    taints: tuple[Taint, ...] = ()  # none by default: KWOK manages nodes by annotation
    # False: KWOK leaves the node and its pods alone, for a stand-in kubelet that drives the
    # real device plugin (carpool_testbed.chaos.StandInKubelet) to run them instead.
    kwok: bool = True
    # More extended resources the Node advertises (e.g. nvidia.com/gpu for a peer scheduler's
    # pods in bench/peers.py), set in code only.
    extra_resources: tuple[tuple[str, str], ...] = ()

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)

    def backend_spec(self) -> dict[str, Any]:
        """The fake backend's spec (carpool.deviceplugin.backends.fake.FakeBackend.from_spec)."""
        groups: list[dict[str, Any]] = []
        for g in self.gpus:
            entry: dict[str, Any] = {
                "model": g.model, "count": g.count,
                "temperatureC": g.temperature_c, "powerW": g.power_w,
            }
            if g.memory_total_mib is not None:
                entry["memoryTotalMiB"] = g.memory_total_mib
            if g.slowdown_temperature_c is not None:
                entry["slowdownTemperatureC"] = g.slowdown_temperature_c
            if g.mig_instances:
                entry["migInstances"] = [
                    {"profile": m.profile, "slices": m.slices, "memoryMiB": m.memory_mib}
                    for m in g.mig_instances
                ]
            groups.append(entry)
        return {"node": self.name, "driverVersion": self.driver_version,
                "cudaVersion": self.cuda_version, "gpus": groups}

    def backend(self) -> FakeBackend:
        return FakeBackend.from_spec(self.backend_spec())


def advertised_shares(node: SimNode) -> int:
    """`carpool.dev/gpu` the node advertises: the device plugin's own per-GPU share count
    (one per MIG instance on a MIG GPU, one on an exclusive node, else `shares_per_gpu`)."""
    return sum(share_count(g, node.sharing, node.shares_per_gpu)
               for g in node.backend().inventory())


# --- parsing ------------------------------------------------------------------------------

_NODE_KEYS = {"name", "replicas", "zone", "sharing", "cpu", "memory", "pods", "sharesPerGpu",
              "datasets", "driverVersion", "cudaVersion", "labels", "taints", "gpus"}
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_GPU_KEYS = {"model", "count", "memoryTotalMiB", "temperatureC", "slowdownTemperatureC",
             "powerW", "migInstances"}
_MIG_KEYS = {"profile", "slices", "memoryMiB"}


def _positive_int(where: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def _number(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _text(where: str, value: object) -> str:
    if not isinstance(value, str | int | float) or isinstance(value, bool) or value == "":
        raise ValueError(f"{where}: must be a non-empty string, got {value!r}")
    return str(value)


def _check_keys(where: str, obj: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(allowed))}")


def _mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _list(where: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be a list, got {type(value).__name__}")
    return value


def _mig(where: str, raw: object) -> SimMig:
    obj = _mapping(where, raw)
    _check_keys(where, obj, _MIG_KEYS)
    slices = _positive_int(f"{where}.slices", obj.get("slices"))
    if slices > 7:
        raise ValueError(f"{where}.slices: a GPU has at most 7 MIG slices, got {slices}")
    return SimMig(profile=_text(f"{where}.profile", obj.get("profile")), slices=slices,
                  memory_mib=_positive_int(f"{where}.memoryMiB", obj.get("memoryMiB")))


def _gpu_group(where: str, raw: object) -> SimGpuGroup:
    obj = _mapping(where, raw)
    _check_keys(where, obj, _GPU_KEYS)
    model = _text(f"{where}.model", obj.get("model"))
    memory = obj.get("memoryTotalMiB")
    if memory is None and model not in GPU_MODEL_MEMORY_MIB:
        raise ValueError(f"{where}.memoryTotalMiB: needed for model {model!r}, which is not "
                         f"one of {', '.join(sorted(GPU_MODEL_MEMORY_MIB))}")
    slowdown = obj.get("slowdownTemperatureC")
    return SimGpuGroup(
        model=model,
        count=_positive_int(f"{where}.count", obj.get("count", 1)),
        memory_total_mib=None if memory is None else _positive_int(f"{where}.memoryTotalMiB",
                                                                   memory),
        temperature_c=_number(f"{where}.temperatureC", obj.get("temperatureC", 40.0)),
        slowdown_temperature_c=None if slowdown is None else _number(
            f"{where}.slowdownTemperatureC", slowdown),
        power_w=_number(f"{where}.powerW", obj.get("powerW", 60.0)),
        mig_instances=tuple(_mig(f"{where}.migInstances[{i}]", m)
                            for i, m in enumerate(_list(f"{where}.migInstances",
                                                        obj.get("migInstances", [])))),
    )


def _taint(where: str, raw: object) -> Taint:
    obj = _mapping(where, raw)
    _check_keys(where, obj, {"key", "value", "effect"})
    effect = str(obj.get("effect", "NoSchedule"))
    if effect not in _TAINT_EFFECTS:
        raise ValueError(f"{where}.effect: must be one of {', '.join(_TAINT_EFFECTS)}, "
                         f"got {effect!r}")
    return Taint(key=_text(f"{where}.key", obj.get("key")), value=str(obj.get("value", "")),
                 effect=effect)


def _node_name(where: str, value: object) -> str:
    name = _text(where, value)
    if not _DNS_SUBDOMAIN.match(name):
        raise ValueError(f"{where}: {name!r} is not a valid node name (lower-case letters, "
                         "digits, '-' and '.')")
    return name


def _nodes_from_entry(where: str, raw: object, default_shares: int) -> list[SimNode]:
    obj = _mapping(where, raw)
    _check_keys(where, obj, _NODE_KEYS)
    base = _node_name(f"{where}.name", obj.get("name"))
    sharing = _text(f"{where}.sharing", obj.get("sharing", "mps"))
    if sharing not in SHARING_MODES:
        raise ValueError(f"{where}.sharing: must be one of {', '.join(sorted(SHARING_MODES))}, "
                         f"got {sharing!r}")
    gpus = tuple(_gpu_group(f"{where}.gpus[{i}]", g)
                 for i, g in enumerate(_list(f"{where}.gpus", obj.get("gpus", []))))
    if not gpus:
        raise ValueError(f"{where}.gpus: a GPU node needs at least one GPU")
    try:
        cpu = quantity_milli(obj.get("cpu", DEFAULT_CPU_MILLI // 1000))
        memory = quantity_mib(obj.get("memory", f"{DEFAULT_MEMORY_MIB}Mi"))
    except ValueError as err:
        raise ValueError(f"{where}: cpu/memory: {err}") from None
    labels = {str(k): _text(f"{where}.labels.{k}", v)
              for k, v in _mapping(f"{where}.labels", obj.get("labels", {})).items()}
    zone = str(obj.get("zone", ""))
    for key, value in [*labels.items(), ("zone", zone)]:
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"{where}: {key} value {value!r} is not a valid label value")
    datasets = tuple(_text(f"{where}.datasets[{i}]", d)
                     for i, d in enumerate(_list(f"{where}.datasets", obj.get("datasets", []))))
    taints = tuple(_taint(f"{where}.taints[{i}]", t)
                   for i, t in enumerate(_list(f"{where}.taints", obj.get("taints", []))))
    replicas = _positive_int(f"{where}.replicas", obj.get("replicas", 1))
    names = [base] if "replicas" not in obj else [f"{base}-{n}" for n in range(replicas)]
    return [
        SimNode(
            name=name, gpus=gpus, zone=zone, sharing=sharing,
            cpu_milli=cpu, memory_mib=memory,
            max_pods=_positive_int(f"{where}.pods", obj.get("pods", DEFAULT_MAX_PODS)),
            shares_per_gpu=_positive_int(f"{where}.sharesPerGpu",
                                         obj.get("sharesPerGpu", default_shares)),
            datasets=datasets,
            driver_version=_text(f"{where}.driverVersion",
                                 obj.get("driverVersion", DEFAULT_DRIVER)),
            cuda_version=_text(f"{where}.cudaVersion", obj.get("cudaVersion", DEFAULT_CUDA)),
            labels=tuple(sorted(labels.items())),
            taints=taints,
        )
        for name in names
    ]


def parse_nodes(document: object, source: str = "nodes",
                shares_per_gpu: int | None = None) -> list[SimNode]:
    """Nodes from a parsed YAML document: `{sharesPerGpu?, nodes: [...]}` or a bare list.

    `shares_per_gpu` (the command line's) overrides the file's default, not a node's own.
    Errors name the file, the entry and the field.
    """
    if isinstance(document, list):
        entries, file_shares = document, None
    else:
        top = _mapping(source, document)
        _check_keys(source, top, {"nodes", "sharesPerGpu"})
        entries = _list(f"{source}: nodes", top.get("nodes"))
        file_shares = top.get("sharesPerGpu")
    if shares_per_gpu is not None:
        default = _positive_int("shares per GPU", shares_per_gpu)
    elif file_shares is not None:
        default = _positive_int(f"{source}: sharesPerGpu", file_shares)
    else:
        default = DEFAULT_SHARES_PER_GPU
    nodes = [n for i, e in enumerate(entries)
             for n in _nodes_from_entry(f"{source}: nodes[{i}]", e, default)]
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise ValueError(f"{source}: node name {node.name!r} appears twice")
        seen.add(node.name)
    return nodes


def load_nodes_yaml(path: Path, shares_per_gpu: int | None = None) -> list[SimNode]:
    return parse_nodes(yaml.safe_load(path.read_text(encoding="utf-8")), str(path),
                       shares_per_gpu)


def nodes_from_openb(rows: Iterable[Mapping[str, str]], *, limit: int | None = None,
                     shares_per_gpu: int = DEFAULT_SHARES_PER_GPU,
                     sharing: str = "mps") -> list[SimNode]:
    """Nodes from the openb node list (`sn,cpu_milli,memory_mib,gpu,model`), in file order.

    Node names are the trace's `sn` lower-cased; zones rotate over OPENB_ZONES by row so a
    replay is deterministic. Rows without GPUs are skipped.
    """
    nodes: list[SimNode] = []
    for line, row in enumerate(rows, start=2):
        if limit is not None and len(nodes) >= limit:
            break
        try:
            count = int(row["gpu"])
            cpu, memory = int(row["cpu_milli"]), int(row["memory_mib"])
            name, model = row["sn"].lower(), row["model"]
        except (KeyError, ValueError, AttributeError) as err:
            raise ValueError(f"openb node list line {line}: not a node row ({err}): "
                             f"{dict(row)!r}") from None
        if count <= 0:
            continue
        if model not in GPU_MODEL_MEMORY_MIB:
            raise ValueError(f"openb node list line {line}: unknown GPU model {model!r}")
        nodes.append(SimNode(
            name=_node_name(f"openb node list line {line}: sn", name),
            gpus=(SimGpuGroup(model=model, count=count),),
            zone=OPENB_ZONES[len(nodes) % len(OPENB_ZONES)],
            sharing=sharing, cpu_milli=cpu, memory_mib=memory, shares_per_gpu=shares_per_gpu,
        ))
    return nodes


def load_openb(path: Path, *, limit: int | None = None,
               shares_per_gpu: int = DEFAULT_SHARES_PER_GPU) -> list[SimNode]:
    with path.open(newline="", encoding="utf-8") as handle:
        return nodes_from_openb(csv.DictReader(handle), limit=limit,
                                shares_per_gpu=shares_per_gpu)


# --- the Kubernetes objects -----------------------------------------------------------------

def gpu_model_label(node: SimNode) -> str:
    models = {g.model for g in node.gpus}
    return models.pop() if len(models) == 1 else "mixed"


def node_labels(node: SimNode) -> dict[str, str]:
    labels = {
        "type": "kwok",
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        # as a kubelet's Node has them; else the node lifecycle controller patches them in
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": "amd64",
        LABEL_SIMULATED: "true",
        LABEL_SHARING: node.sharing,
        LABEL_GPU_MODEL: gpu_model_label(node),
        LABEL_GPU_COUNT: str(node.gpu_count),
    }
    if node.zone:
        labels[LABEL_ZONE] = node.zone
    labels.update(node.labels)
    return labels


def node_resources(node: SimNode) -> dict[str, str]:
    """Capacity, equal to allocatable (nothing is reserved on a simulated node)."""
    return {
        "cpu": f"{node.cpu_milli}m" if node.cpu_milli % 1000 else str(node.cpu_milli // 1000),
        "memory": f"{node.memory_mib}Mi",
        "pods": str(node.max_pods),
        RESOURCE_GPU: str(advertised_shares(node)),
        **dict(node.extra_resources),
    }


def node_manifest(node: SimNode) -> dict[str, Any]:
    """The KWOK Node (metadata and spec; its status is applied through /status).

    No taint unless asked for: KWOK manages the node because of its annotation, and Carpool's
    pods then need no toleration. Without `node.kwok` the annotation is left out.
    """
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    if node.kwok:
        annotations = {KWOK_NODE_ANNOTATION: "fake", **annotations}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": node_labels(node),
            "annotations": annotations,
        },
        "spec": {"taints": [t.manifest() for t in node.taints]} if node.taints else {},
    }


def node_status_manifest(node: SimNode) -> dict[str, Any]:
    resources = node_resources(node)
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name},
            "status": {"capacity": dict(resources), "allocatable": dict(resources)}}


def gpunode_status(node: SimNode, now: datetime) -> dict[str, Any]:
    """The GpuNode status the device plugin would publish for this node's (fake) GPUs."""
    status = status_from_backend(node.backend(), sharing_mode=node.sharing, now=now,
                                 datasets=node.datasets, shares_per_gpu=node.shares_per_gpu)
    status["zone"] = node.zone
    return status


def gpunode_manifest(node: SimNode, node_uid: str | None = None) -> dict[str, Any]:
    """The GpuNode object (owned by the Node when its uid is known, so it goes with it)."""
    metadata: dict[str, Any] = {"name": node.name, "labels": {LABEL_SIMULATED: "true"}}
    if node_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node.name,
                                        "uid": node_uid}]
    return {"apiVersion": API_VERSION, "kind": "GpuNode", "metadata": metadata, "spec": {}}


# --- talking to the cluster ---------------------------------------------------------------

def api_client(kubeconfig: str | Path | None = None) -> Any:
    """A `carpool.kube` client for a kubeconfig file (default: $KUBECONFIG or ~/.kube/config)."""
    from carpool.kube.client import Api

    return Api.load(kubeconfig)


def apply_node(api: Any, node: SimNode, now: datetime) -> None:
    """Create or update one node's Node and GpuNode, status included (idempotent); `api`: a
    `carpool.kube` `Api` or a kubernetes `ApiClient`."""
    from carpool.kube.client import Api
    from carpool.kube.resources import GPUNODES, NODES

    kube = Api.of(api)
    # The status goes in with the Node itself: KWOK initialises a node's status the moment it
    # appears, and one it saw without capacity gets KWOK's defaults (cpu "1k"). On an existing
    # Node the main endpoint ignores status, so it is applied through /status when the answer
    # shows other resources (a new Node keeps what it was created with: one write fewer).
    status = node_status_manifest(node)
    applied = kube.apply(NODES.path(None, node.name),
                         {**node_manifest(node), "status": status["status"]}, FIELD_MANAGER)
    if not resources_hold(applied, status["status"]):
        kube.apply(NODES.path(None, node.name, "status"), status, FIELD_MANAGER)
    _drop_stale_taints(kube, node, applied)
    uid = (applied.get("metadata") or {}).get("uid")
    kube.apply(GPUNODES.path(None, node.name), gpunode_manifest(node, uid), FIELD_MANAGER)
    kube.apply(GPUNODES.path(None, node.name, "status"),
               {"apiVersion": API_VERSION, "kind": "GpuNode", "metadata": {"name": node.name},
                "status": gpunode_status(node, now)}, FIELD_MANAGER)


def resources_hold(node: Mapping[str, Any], wanted: Mapping[str, Mapping[str, str]]) -> bool:
    """Whether the Node's status has each wanted capacity and allocatable quantity (by value:
    the API server may write "262144Mi" as "256Gi")."""
    have = node.get("status") or {}
    for part, quantities in wanted.items():
        current = have.get(part) or {}
        for name, value in quantities.items():
            if name not in current or parse_quantity(current[name]) != parse_quantity(value):
                return False
    return True


def _taint_keys(taints: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    return sorted((str(t.get("key")), str(t.get("effect") or "")) for t in taints)


def _drop_stale_taints(kube: Any, node: SimNode, applied: Mapping[str, Any]) -> None:
    """Make the Node's taints the file's (plus the system's own `node.kubernetes.io/*` ones).

    `spec.taints` is an atomic list: once the node lifecycle controller has written it, it owns
    the whole list and a server-side apply no longer removes a taint the file dropped.
    """
    from carpool.kube.resources import NODES

    wanted = list(node_manifest(node)["spec"].get("taints") or [])
    current = list((applied.get("spec") or {}).get("taints") or [])
    system = [{k: v for k, v in t.items() if v is not None} for t in current
              if str(t.get("key", "")).startswith("node.kubernetes.io/")]
    desired = wanted + system
    if _taint_keys(desired) != _taint_keys(current):
        kube.patch(NODES.path(None, node.name), {"spec": {"taints": desired or None}})


def _each(work: Callable[[str], object], names: Sequence[str], workers: int) -> None:
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names) or 1))) as pool:
        for _ in pool.map(work, names):
            pass


def apply_nodes(api: Any, nodes: Sequence[SimNode], now: datetime | None = None,
                workers: int = 8) -> None:
    """Apply every node (a few in parallel: each is four small requests)."""
    from carpool.kube.client import Api

    kube = Api.of(api)
    when = now or datetime.now(UTC)
    by_name = {n.name: n for n in nodes}
    _each(lambda name: apply_node(kube, by_name[name], when), list(by_name), workers)


def simulated_node_names(api: Any) -> list[str]:
    """Names of every Node this module created (label carpool.dev/simulated=true)."""
    from carpool.kube.client import Api
    from carpool.kube.resources import NODES

    listed, _ = Api.of(api).list_all(NODES.path(), {"labelSelector": f"{LABEL_SIMULATED}=true"})
    return sorted(name for n in listed if (name := (n.get("metadata") or {}).get("name")))


def delete_nodes(api: Any, names: Sequence[str], workers: int = 8) -> None:
    """Delete the Nodes and GpuNodes of these names; absent ones are fine."""
    from carpool.kube.client import Api
    from carpool.kube.resources import GPUNODES, NODES

    kube = Api.of(api)

    def delete(name: str) -> None:
        kube.delete(NODES.path(None, name))
        kube.delete(GPUNODES.path(None, name))

    _each(delete, list(names), workers)


def beat(api: Any, names: Sequence[str], now: datetime | None = None, workers: int = 8) -> None:
    """Refresh the heartbeat of simulated GpuNodes, as a live device plugin does, so readers
    that treat a stale heartbeat as a dead plugin keep using them."""
    from carpool.kube.client import Api
    from carpool.kube.resources import GPUNODES

    kube = Api.of(api)
    stamp = format_timestamp((now or datetime.now(UTC)).timestamp())
    body = {"status": {"heartbeat": stamp}}
    _each(lambda name: kube.patch(GPUNODES.path(None, name, "status"), body,
                                  query={"fieldManager": FIELD_MANAGER}),
          list(names), workers)


def summary(nodes: Sequence[SimNode]) -> str:
    """One line: how many nodes, GPUs and shares, by model."""
    by_model: dict[str, int] = {}
    for node in nodes:
        for g in node.gpus:
            by_model[g.model] = by_model.get(g.model, 0) + g.count
    shares = sum(advertised_shares(n) for n in nodes)
    models = ", ".join(f"{count} {model}" for model, count in sorted(by_model.items()))
    return (f"{len(nodes)} nodes, {sum(by_model.values())} GPUs ({models}), "
            f"{shares} {RESOURCE_GPU} shares")


def to_json(nodes: Sequence[SimNode], now: datetime) -> str:
    """Every object `apply_nodes` would send, for `--dry-run` output."""
    objects: list[dict[str, Any]] = []
    for node in nodes:
        manifest = node_manifest(node)
        manifest["status"] = node_status_manifest(node)["status"]
        gpunode = gpunode_manifest(node)
        gpunode["status"] = gpunode_status(node, now)
        objects += [manifest, gpunode]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2)
