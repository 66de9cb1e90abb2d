"""Memory watchdog: time-sliced pods have no hard memory cap, and an MPS client that raised its
own limit is held only at its GPU's ceiling (mps.py), so the plugin watches
per-process GPU memory, maps processes to pods through their cgroups, warns, and kills a pod's
processes on that GPU after `max_strikes` consecutive readings over its grant.

`pod_uid_from_cgroup` and `watchdog_step` are pure; the loop that reads /proc, kills and posts
Events lives in `agent.py`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from carpool.deviceplugin.backends.base import ProcessMemory

# cgroupfs: .../kubepods/burstable/pod1b4e…/<container>; systemd driver:
# .../kubepods-burstable-pod1b4e_28c1_….slice/cri-containerd-<id>.scope
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)

PodGpu = tuple[str, str]  # (pod uid, GPU uuid)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in a /proc/<pid>/cgroup file's text, or None for a process outside pods."""
    for line in text.splitlines():
        found = _POD_UID.search(line)
        if found:
            return found.group(1).replace("_", "-")
    return None


def pod_of_pid(pid: int, proc: Path = Path("/proc")) -> str | None:
    try:
        return pod_uid_from_cgroup((proc / str(pid) / "cgroup").read_text())
    except OSError:
        return None  # the process is gone, or we cannot see it


@dataclass(frozen=True)
class MemoryGrant:
    """A time-sliced or MPS pod's memory grant on one GPU."""

    pod_uid: str
    namespace: str
    name: str
    gpu_uuid: str
    limit_mib: int


class Verdict(enum.Enum):
    WARN = "warn"
    KILL = "kill"


@dataclass(frozen=True)
class Violation:
    grant: MemoryGrant
    used_mib: int
    strike: int
    verdict: Verdict
    pids: tuple[int, ...]


def usage_by_pod(processes: Iterable[ProcessMemory],
                 pod_of: Mapping[int, str | None]) -> dict[PodGpu, tuple[int, tuple[int, ...]]]:
    """GPU memory per (pod, GPU) and the pids holding it; processes outside pods are skipped."""
    out: dict[PodGpu, tuple[int, tuple[int, ...]]] = {}
    for p in processes:
        uid = pod_of.get(p.pid)
        if uid is None:
            continue
        used, pids = out.get((uid, p.gpu_uuid), (0, ()))
        out[(uid, p.gpu_uuid)] = (used + p.used_mib, (*pids, p.pid))
    return out


def watchdog_step(
    strikes: Mapping[PodGpu, int],
    usage: Mapping[PodGpu, tuple[int, tuple[int, ...]]],
    grants: Iterable[MemoryGrant],
    max_strikes: int = 3,
) -> tuple[dict[PodGpu, int], list[Violation]]:
    """One reading: new strike counts and what to do. A reading within the grant clears the
    pod's strikes (violations must be consecutive); the `max_strikes`-th one in a row kills."""
    new: dict[PodGpu, int] = {}
    violations = []
    for grant in sorted(grants, key=lambda g: (g.namespace, g.name, g.gpu_uuid)):
        key = (grant.pod_uid, grant.gpu_uuid)
        used, pids = usage.get(key, (0, ()))
        if used <= grant.limit_mib:
            continue
        strike = strikes.get(key, 0) + 1
        verdict = Verdict.KILL if strike >= max_strikes else Verdict.WARN
        violations.append(Violation(grant, used, strike, verdict, pids))
        if verdict is Verdict.WARN:
            new[key] = strike
    return new, violations
