"""Topology domains: which nodes sit close together, from labels the platform team sets.

A gang's workers talk to each other through collectives whose speed depends on how far apart
they are, so a gang goes into the smallest domain that holds all of it. Domains nest from a
single host up to the whole cluster; each level between is read from one node label (the
table below is the one place these keys live). A node without a level's label belongs to no
domain of that level (only to its own host and the cluster).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from carpool.core.names import GROUP, LABEL_ZONE
from carpool.core.resources import NodeInventory


class TopologyLevel(enum.IntEnum):
    """Domain levels, smallest first (the order a gang's placement tries them in)."""

    HOST = 0
    NVLINK_ISLAND = 1  # nodes joined by an NVLink/NVSwitch fabric
    RACK = 2
    BLOCK = 3  # racks under one spine switch
    ZONE = 4
    CLUSTER = 5

    @property
    def label(self) -> str:
        """The level's name in a GpuJob spec (`spec.topology.level`)."""
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> TopologyLevel:
        for level in cls:
            if level.label == text:
                return level
        raise ValueError(f"unknown topology level {text!r}; expected one of "
                         f"{', '.join(level.label for level in cls)}")


# The node label each level between host and cluster is read from.
TOPOLOGY_LABELS: Mapping[TopologyLevel, str] = {
    TopologyLevel.NVLINK_ISLAND: f"{GROUP}/nvlink-island",
    TopologyLevel.RACK: f"topology.{GROUP}/rack",
    TopologyLevel.BLOCK: f"topology.{GROUP}/block",
    TopologyLevel.ZONE: LABEL_ZONE,
}


class TopologyMode(enum.Enum):
    """`required`: the gang waits until one domain of its level holds it; `preferred`: the
    smallest domain that holds it now, or else anywhere."""

    REQUIRED = "required"
    PREFERRED = "preferred"

    @classmethod
    def parse(cls, text: str) -> TopologyMode:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown topology mode {text!r}; expected one of "
                             f"{', '.join(m.value for m in cls)}") from None


@dataclass(frozen=True)
class TopologyNeed:
    """What a gang asks of where its workers go (`spec.topology`)."""

    level: TopologyLevel
    mode: TopologyMode = TopologyMode.PREFERRED

    def levels(self) -> tuple[TopologyLevel, ...]:
        """The levels a placement may use, smallest first."""
        top = self.level if self.mode is TopologyMode.REQUIRED else TopologyLevel.CLUSTER
        return tuple(level for level in TopologyLevel if level <= top)


ANYWHERE = TopologyNeed(TopologyLevel.CLUSTER)


def domain_of(inventory: NodeInventory, level: TopologyLevel) -> str | None:
    """The node's domain at `level`: its name for a host, "" for the cluster, the label's
    value in between (None: the node carries no such label)."""
    if level is TopologyLevel.HOST:
        return inventory.name
    if level is TopologyLevel.CLUSTER:
        return ""
    key = TOPOLOGY_LABELS[level]
    return next((v for k, v in inventory.labels if k == key and v), None)


def domains(inventories: Iterable[NodeInventory], level: TopologyLevel
            ) -> dict[str, tuple[str, ...]]:
    """Each domain of `level` with its nodes' names (sorted)."""
    out: dict[str, list[str]] = {}
    for inventory in inventories:
        domain = domain_of(inventory, level)
        if domain is not None:
            out.setdefault(domain, []).append(inventory.name)
    return {domain: tuple(sorted(names)) for domain, names in out.items()}


@dataclass(frozen=True)
class Domain:
    """One domain: its level, its name (see `domain_of`), its nodes and their GPUs in all."""

    level: TopologyLevel
    name: str
    nodes: tuple[str, ...]
    gpus: int


def domain_index(inventories: Iterable[NodeInventory]) -> dict[TopologyLevel,
                                                                tuple[Domain, ...]]:
    """Every domain of every level (the nodes never change within one admission cycle, so a
    cycle builds this once)."""
    inventories = list(inventories)
    gpus = {inv.name: len(inv.gpus) for inv in inventories}
    return {level: tuple(Domain(level, name, nodes, sum(gpus[n] for n in nodes))
                         for name, nodes in sorted(domains(inventories, level).items()))
            for level in TopologyLevel}
