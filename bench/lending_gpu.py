"""Lending within a GPU with real MPS clients: the owner's reclaim, and the watchdog behind a
borrower's grant.

Four MPS clients share one GPU, each started with the environment the device plugin's Allocate
returned over its real gRPC socket (`gpu_sharing.plugin_allocations`), under the plugin's MPS
daemon fenced at its ceiling (50 %): a *service* holding most of its grant, an *owner* idle
in a large grant, a preemptible *borrower* whose grant fits the GPU only in the part of the
owner's grant that `core.lending` lends, and later a *rogue* borrower. Sizes are shares of the
GPU's memory T: service 0.42 T (holds 0.39 T), owner 0.45 T (idle at 0.04 T), borrower 0.28 T
(holds 0.25 T; the GPU has 0.13 T free without the lent part).

This script plays the operator, every second, with the product's code: the plugin's watchdog
and telemetry read each client's memory from NVML (`Watchdog.step`), `lending.lendable` turns
the owner's measured peak into its lent part once it ran the observation time, and
`lending.reclaims` names the borrowers to stop. The owner then grows by 0.007 T a second up to
0.43 T, which it can reach only once the borrower has left (0.43 + 0.39 + 0.25 > 1): past a
peak of 0.25 T its lent part no longer covers the borrower, which gets SIGTERM, saves a
checkpoint (`torch.save` of its state) and exits; SIGKILL follows if it is still there after
its grace. Reported: when the reclaim was decided (the owner's measured peak), SIGTERM to
checkpoint saved and to exit, every allocation the owner asked for (refused ones counted), the
most memory NVML showed in use. Then the watchdog part: a borrower granted 0.1 T that raised
its MPS memory limit to the ceiling and holds 0.2 T is warned at each reading and killed at the
third (`--watchdog-strikes`).

  python3 bench/lending_gpu.py                # on the GPU machine (CUDA, MPS, NVML)
  python3 bench/lending_gpu.py --device cpu   # the logic anywhere: fake backend, no MPS

`--device cpu` checks the script: the workers allocate nothing, the fake backend reports what
they say they hold, and a growth the GPU could not hold is refused by this script's model of
it; its numbers say nothing about GPUs. Needs the `carpool` package importable (and torch on
the GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpu_sharing import EventLog  # a sibling script: its directory is on sys.path when run

MIB_PER_GIB = 1024
WORKER_FLAG = "--worker"
CHUNK_MIB = 256  # a worker grows and shrinks in blocks of this size
CEILING_PCT = 50  # the plugin's default MPS ceiling
# shares of the GPU's memory (see the docstring)
SERVICE_GRANT, SERVICE_HOLD = 0.42, 0.39
OWNER_GRANT, OWNER_IDLE, OWNER_TOP, OWNER_RATE = 0.45, 0.04, 0.43, 0.007
BORROWER_GRANT, BORROWER_HOLD = 0.28, 0.25
ROGUE_GRANT, ROGUE_HOLD = 0.10, 0.20
CHECKPOINT_MIB = 256  # the state the borrower saves on SIGTERM


# --- worker side (a subprocess started with the plugin's environment) --------------------------


class Holder:
    """GPU memory this worker holds, in blocks; `device` cpu only counts it."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.blocks: list[Any] = []
        self.refused = 0
        if device == "cuda":
            import torch

            torch.cuda.init()
            torch.empty(1, device="cuda")  # the context, before anything is measured

    @property
    def held_mib(self) -> int:
        return len(self.blocks) * CHUNK_MIB

    def hold(self, mib: int, free_mib: int) -> None:
        """Grow or shrink to `mib`; a block the GPU refuses (or, on cpu, that `free_mib` does
        not cover) is counted and growth stops there."""
        while self.held_mib > mib:
            self.blocks.pop()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        while self.held_mib + CHUNK_MIB <= mib:
            if self.device == "cuda":
                import torch

                try:
                    block = torch.empty(CHUNK_MIB * 2**20, dtype=torch.uint8, device="cuda")
                    block.fill_(1)
                    torch.cuda.synchronize()
                except RuntimeError:  # torch.OutOfMemoryError, or a CUDA error under MPS
                    self.refused += 1
                    return
            else:
                if free_mib < CHUNK_MIB:
                    self.refused += 1
                    return
                free_mib -= CHUNK_MIB
                block = None
            self.blocks.append(block)


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def worker(device: str, role: str, checkpoint_dir: str) -> int:
    """Follows `hold MiB FREE` lines on stdin, answering what it holds. A borrower also
    computes between commands, and on SIGTERM saves a checkpoint and exits."""
    holder = Holder(device)
    stopping = {"at": 0.0}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(at=time.time()))
    say(ready=True, pid=os.getpid())
    work = None
    if device == "cuda" and role == "borrower":
        import torch

        work = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    while not stopping["at"]:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if ready:
            line = sys.stdin.readline()
            if not line:
                return 0
            _, mib, free = line.split()
            holder.hold(int(mib), int(free))
            say(held=holder.held_mib, refused=holder.refused)
        if work is not None:
            work = (work @ work).clamp_(-1, 1)
    # SIGTERM: save what it has (a GPU tensor copied out) and leave
    path = Path(checkpoint_dir) / f"{role}-{os.getpid()}.pt"
    if device == "cuda":
        import torch

        state = torch.empty(CHECKPOINT_MIB * 2**20, dtype=torch.uint8, device="cuda")
        torch.save({"state": state.cpu()}, path)
    else:
        path.write_bytes(b"\0" * (CHECKPOINT_MIB * 2**20 // 64))
    with path.open("rb") as saved:
        os.fsync(saved.fileno())
    say(checkpoint=str(path), saved=time.time(), signalled=stopping["at"])
    return 0


# --- parent side ----------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {text}", flush=True)


@dataclass
class Client:
    """One MPS client: its pod as the plugin sees it, its process, what it holds."""

    role: str
    grant_mib: int
    env: dict[str, str]
    pod: Any
    proc: subprocess.Popen[str] | None = None
    pid: int = 0
    held_mib: int = 0
    refused: int = 0
    lines: list[dict[str, Any]] = field(default_factory=list)

    def start(self, device: str, checkpoint_dir: Path) -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        import gpu_sharing

        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), WORKER_FLAG, device, self.role,
             str(checkpoint_dir)], env=gpu_sharing.client_env(self.env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        ready = self.read(timeout_s=120)
        if ready is None or not ready.get("ready"):
            raise RuntimeError(f"{self.role} did not start: {ready}")
        self.pid = int(ready["pid"])

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            return None
        parsed: dict[str, Any] = json.loads(line)
        self.lines.append(parsed)
        return parsed

    def hold(self, mib: int, free_mib: int) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"hold {mib} {free_mib}\n")
        self.proc.stdin.flush()
        answer = self.read(timeout_s=60)
        if answer is None or "held" not in answer:
            raise RuntimeError(f"{self.role} did not answer: {answer}")
        self.held_mib, self.refused = int(answer["held"]), int(answer["refused"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class Gpu:
    """The GPU, its clients and the product's code that watches them."""

    device: str
    backend: Any
    facts: Any  # the GPU's GpuFacts at the start
    total_mib: int
    uuid: str
    clients: dict[str, Client] = field(default_factory=dict)
    writer: EventLog = field(default_factory=EventLog)
    watchdog: Any = None
    most_used_mib: int = 0

    def free_mib(self) -> int:
        """What the GPU has left (the cpu model's; on cuda the driver decides)."""
        return self.total_mib - sum(c.held_mib for c in self.clients.values() if c.alive())

    def publish(self) -> None:
        """On cpu, the fake backend reports what the live clients hold (NVML does on cuda)."""
        if self.device == "cpu":
            from carpool.deviceplugin.backends.base import ProcessMemory

            self.backend.set_processes([ProcessMemory(c.pid, self.uuid, c.held_mib)
                                        for c in self.clients.values()
                                        if c.alive() and c.held_mib])

    def reading(self) -> list[str]:
        """One watchdog reading (NVML or the fake); returns its warnings and kills."""
        self.publish()
        done: list[str] = asyncio.run(self.watchdog.step())
        used = (sum(c.held_mib for c in self.clients.values() if c.alive())
                if self.device == "cpu" else self.backend.inventory()[0].memory_used_mib)
        self.most_used_mib = max(self.most_used_mib, used)
        return done

    def peak_mib(self, role: str) -> int | None:
        pod = self.clients[role].pod
        peak = self.watchdog.telemetry.peaks.get((pod.namespace, pod.name, self.uuid))
        return None if peak is None else int(peak)


def setup(device: str, pipe_dir: Path, strikes: int) -> Gpu:
    """The backend, the Allocate answers for the four pods, and the watchdog over them."""
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_sharing

    from carpool.deviceplugin.agent import Telemetry, Watchdog
    from carpool.deviceplugin.plugin import PluginConfig, PluginState
    from carpool.deviceplugin.pods import StaticPodSource

    if device == "cuda":
        from carpool.deviceplugin.backends.nvml import NvmlBackend

        backend: Any = NvmlBackend()
    else:
        from carpool.deviceplugin.backends.fake import FakeBackend

        backend = FakeBackend.from_spec({"node": "bench-node", "gpus": [{"model": "H200"}]})
    facts = backend.inventory()[0]
    total = facts.memory_total_mib
    sizes = {"service": SERVICE_GRANT, "owner": OWNER_GRANT, "borrower": BORROWER_GRANT,
             "rogue": ROGUE_GRANT}
    grants = {role: int(share * total) // MIB_PER_GIB * MIB_PER_GIB
              for role, share in sizes.items()}
    answers = asyncio.run(gpu_sharing.plugin_allocations(
        backend, pipe_dir, [(role, "mps", mib, 0) for role, mib in grants.items()],
        CEILING_PCT))
    gpu = Gpu(device, backend, facts, total, facts.uuid)
    pods = []
    for answer in answers:
        role = answer["pod"]
        env = gpu_sharing.host_env(answer)
        if device != "cuda":
            env = {k: v for k, v in env.items()
                   if not k.startswith("CUDA_") and k != "NVIDIA_VISIBLE_DEVICES"}
        pod = replace(gpu_sharing.pod_view(role, facts.uuid, facts.index, grants[role], 0,
                                           "mps"), phase="Running")
        pods.append(pod)
        gpu.clients[role] = Client(role, grants[role], env, pod)
    state = PluginState(PluginConfig("bench-node", "mps"), backend, StaticPodSource(pods))
    by_pid = lambda pid: next((c.pod.uid for c in gpu.clients.values()  # noqa: E731
                               if c.pid == pid), None)
    gpu.watchdog = Watchdog(state, gpu.writer, Telemetry(state, gpu.writer), strikes,
                            pod_of=by_pid)
    return gpu


def node_state(gpu: Gpu, lent_mib: int, borrowing: bool) -> Any:
    """The GPU as the operator holds it: the service's and owner's grants (the owner's lent
    part split off) and, if `borrowing`, the borrower's grant in the lent part."""
    from carpool.core import lending
    from carpool.core.placement import NodeState
    from carpool.core.resources import Gpu as CoreGpu
    from carpool.core.resources import GpuGrant, NodeInventory

    facts = gpu.facts
    inventory = NodeInventory("bench-node", (CoreGpu(
        facts.index, facts.uuid, facts.model, facts.memory_total_mib,
        mps_ceiling_pct=CEILING_PCT),))
    grants = (GpuGrant(gpu.uuid, gpu.clients["service"].grant_mib, 0),
              *lending.split((GpuGrant(gpu.uuid, gpu.clients["owner"].grant_mib, 0),),
                             lent_mib, 0))
    if borrowing:
        grants += lending.as_borrowed((GpuGrant(gpu.uuid, gpu.clients["borrower"].grant_mib,
                                                0),))
    return NodeState(inventory, grants)


def reclaim_run(gpu: Gpu, device: str, checkpoint_dir: Path, grace_s: float,
                observed_s: float) -> dict[str, Any]:
    """The owner idles until its peak is trusted, the borrower is placed in the lent part,
    the owner grows; returns what happened."""
    from carpool.core import lending

    policy = lending.LendingPolicy(observed_s=observed_s, reclaim_within_s=grace_s)
    share = gpu.total_mib / 100  # MiB per % of the GPU
    clients = gpu.clients
    service, owner, borrower = clients["service"], clients["owner"], clients["borrower"]
    for client, hold in ((service, SERVICE_HOLD), (owner, OWNER_IDLE)):
        client.start(device, checkpoint_dir)
        client.hold(int(hold * 100 * share), gpu.free_mib())
    owner_started = time.monotonic()
    report: dict[str, Any] = {"total_mib": gpu.total_mib,
                              "grants_mib": {r: c.grant_mib for r, c in clients.items()}}
    # the owner runs its observation time; its measured peak sets what it lends
    lent = 0
    while True:
        gpu.reading()
        peak = gpu.peak_mib("owner")
        lent, _ = lending.lendable(grant_of(owner, gpu.uuid), peak, None,
                                   time.monotonic() - owner_started, policy)
        if lent > 0:
            break
        if time.monotonic() - owner_started > observed_s + 60:
            raise RuntimeError(f"the owner's peak was never measured ({peak})")
        time.sleep(1.0)
    free_alone = node_state(gpu, 0, False).free()[0].memory_mib
    free_lent = lending.borrower_view(node_state(gpu, lent, False)).free()[0].memory_mib
    report["placement"] = {"owner_peak_mib": peak, "lent_mib": lent,
                           "free_without_lending_mib": free_alone,
                           "free_to_borrowers_mib": free_lent,
                           "fits_only_in_lent": free_alone < borrower.grant_mib <= free_lent}
    log(f"owner's measured peak {peak} MiB: {lent} MiB lent; the borrower's "
        f"{borrower.grant_mib} MiB fit {free_lent} MiB with lending, {free_alone} MiB without")
    if not report["placement"]["fits_only_in_lent"]:
        raise RuntimeError(f"the borrower does not fit only in the lent part: {report}")
    borrower.start(device, checkpoint_dir)
    borrower.hold(int(BORROWER_HOLD * 100 * share), gpu.free_mib())
    log(f"borrower holds {borrower.held_mib} MiB; the owner grows by "
        f"{OWNER_RATE * 100 * share:.0f} MiB/s towards {int(OWNER_TOP * 100 * share)} MiB")
    want, top = owner.held_mib, int(OWNER_TOP * 100 * share) // CHUNK_MIB * CHUNK_MIB
    told = gone = None
    saved: float | None = None
    told_wall = 0.0
    decided_peak = None
    asked: list[tuple[float, int, int]] = []  # (time, wanted, held)
    began = time.monotonic()
    while time.monotonic() - began < 300:
        step_started = time.monotonic()
        want = min(top, want + int(OWNER_RATE * 100 * share))
        owner.hold(want, gpu.free_mib())
        asked.append((round(time.monotonic() - began, 2), want, owner.held_mib))
        warnings = gpu.reading()
        if warnings:
            report.setdefault("warnings", []).extend(warnings)
        peak = gpu.peak_mib("owner")
        lent, _ = lending.lendable(grant_of(owner, gpu.uuid), peak, None,
                                   time.monotonic() - owner_started, policy)
        if told is None and borrower.alive():
            stop = lending.reclaims(node_state(gpu, lent, True), {
                "borrower": (0.0, (grant_of(borrower, gpu.uuid, borrowed=True),))})
            if stop:
                told, told_wall, decided_peak = time.monotonic(), time.time(), peak
                assert borrower.proc is not None
                borrower.proc.send_signal(signal.SIGTERM)
                log(f"reclaim: the owner's measured peak {peak} MiB leaves {lent} MiB lent; "
                    f"SIGTERM to the borrower")
        if told is not None and saved is None:
            saved = checkpoint_saved(borrower, report, 0.0)
        if told is not None and gone is None:
            if not borrower.alive():
                gone = time.monotonic()
                borrower.held_mib = 0
            elif time.monotonic() - told > grace_s:
                borrower.stop()  # SIGKILL: its grace is over
                gone = time.monotonic()
                report["killed_after_grace"] = True
        if owner.held_mib >= top and gone is not None:
            break
        next_step = step_started + 1.0
        while told is not None and gone is None and time.monotonic() < next_step:
            if not borrower.alive():  # its exit, timed to 20 ms
                gone = time.monotonic()
                borrower.held_mib = 0
            time.sleep(0.02)
        time.sleep(max(0.0, next_step - time.monotonic()))
    if told is not None and saved is None:
        saved = checkpoint_saved(borrower, report, 5.0)
    report["reclaim"] = {
        "decided_at_owner_peak_mib": decided_peak,
        "trigger_peak_mib": trigger_peak(gpu),
        "sigterm_to_checkpoint_s": None if saved is None else saved - told_wall,
        "sigterm_to_gone_s": None if told is None or gone is None else gone - told,
        "grace_s": grace_s,
    }
    report["owner"] = {"asked_up_to_mib": want, "held_mib": owner.held_mib,
                       "refused_allocations": owner.refused, "ramp": asked}
    report["most_used_mib"] = gpu.most_used_mib
    report["would_not_fit_with_borrower"] = (
        top + service.held_mib + int(BORROWER_HOLD * 100 * share) > gpu.total_mib)
    return report


def checkpoint_saved(borrower: Client, report: dict[str, Any], wait_s: float) -> float | None:
    """When the borrower said it saved its checkpoint (its wall clock), if it has said so."""
    line = borrower.read(timeout_s=wait_s)
    if line and "checkpoint" in line:
        report["checkpoint"] = line
        return float(line["saved"])
    return None


def grant_of(client: Client, uuid: str, borrowed: bool = False) -> Any:
    from carpool.core.resources import GpuGrant

    return GpuGrant(uuid, client.grant_mib, 0, borrowed=borrowed)


def trigger_peak(gpu: Gpu) -> int:
    """The owner's peak past which its lent part no longer covers the borrower."""
    from carpool.core import lending

    policy = lending.LendingPolicy(observed_s=0)
    grant = grant_of(gpu.clients["owner"], gpu.uuid)
    for peak in range(0, grant.memory_mib + 1, 64):
        lent, _ = lending.lendable(grant, peak, None, 1.0, policy)
        if lending.reclaims(node_state(gpu, lent, True), {
                "borrower": (0.0, (grant_of(gpu.clients["borrower"], gpu.uuid, True),))}):
            return peak
    return int(grant.memory_mib)


def watchdog_run(gpu: Gpu, device: str, checkpoint_dir: Path, strikes: int) -> dict[str, Any]:
    """A borrower that raised its MPS memory limit to the ceiling and holds twice its grant,
    alone on the GPU (the reclaim's clients have ended)."""
    for role in ("service", "owner", "borrower"):
        gpu.clients[role].stop()
    rogue = gpu.clients["rogue"]
    if device == "cuda":
        ceiling = gpu.total_mib * CEILING_PCT // 100 // MIB_PER_GIB
        rogue.env = {**rogue.env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={ceiling}G"}
    rogue.start(device, checkpoint_dir)
    rogue.hold(int(ROGUE_HOLD * gpu.total_mib), gpu.free_mib())
    log(f"rogue holds {rogue.held_mib} MiB of a {rogue.grant_mib} MiB grant")
    readings = []
    for _ in range(strikes + 2):
        readings.append(gpu.reading())
        if not rogue.alive():
            break
        time.sleep(1.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        assert rogue.proc is not None
        rogue.proc.wait(timeout=10)
    return {"grant_mib": rogue.grant_mib, "held_mib": rogue.held_mib, "readings": readings,
            "killed": rogue.proc is not None and rogue.proc.returncode == -signal.SIGKILL,
            "events": list(gpu.writer.events)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        return worker(sys.argv[2], sys.argv[3], sys.argv[4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="the borrower's checkpoint grace, s (at most the reclaim bound)")
    parser.add_argument("--observed", type=float, default=5.0,
                        help="how long the owner runs before its peak is trusted, s")
    parser.add_argument("--watchdog-strikes", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="carpool-lending-", dir="/tmp"))
    pipe_dir, log_dir, checkpoints = root / "pipe", root / "log", root / "checkpoints"
    checkpoints.mkdir(parents=True)
    gpu = setup(args.device, pipe_dir, args.watchdog_strikes)
    facts = gpu.backend.inventory()[0]
    log(f"{facts.model}, {gpu.total_mib} MiB; Allocate answered: " + json.dumps(
        {r: {k: v for k, v in c.env.items() if k.startswith("CUDA_MPS")}
         for r, c in gpu.clients.items()}))
    daemon = None
    if args.device == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        import gpu_sharing

        from carpool.deviceplugin.mps import MpsDaemon

        daemon = MpsDaemon(pipe_dir, log_dir, binary=gpu_sharing.find_mps_control())
        daemon.start()
        daemon.fence(CEILING_PCT, [(g.uuid, g.memory_total_mib)
                                   for g in gpu.backend.inventory()])
    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "device": args.device, "gpu": facts.model}
    try:
        report["lending"] = reclaim_run(gpu, args.device, checkpoints, args.grace,
                                        args.observed)
        gpu.writer.events.clear()
        report["watchdog"] = watchdog_run(gpu, args.device, checkpoints,
                                          args.watchdog_strikes)
    finally:
        for client in gpu.clients.values():
            client.stop()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return summarize(report, args)


def summarize(report: dict[str, Any], args: argparse.Namespace) -> int:
    """Prints the findings; exit 1 if the owner was refused memory, the borrower outlived its
    grace or the watchdog let the rogue run."""
    lent, dog = report["lending"], report["watchdog"]
    reclaim, owner = lent["reclaim"], lent["owner"]
    problems = []
    if owner["refused_allocations"]:
        problems.append(f"the owner was refused {owner['refused_allocations']} allocation(s)")
    if reclaim["sigterm_to_gone_s"] is None or lent.get("killed_after_grace"):
        problems.append("the borrower did not leave within its grace")
    if "checkpoint" not in lent:
        problems.append("the borrower saved no checkpoint")
    if not dog["killed"]:
        problems.append("the watchdog did not kill the rogue borrower")
    if lent.get("warnings"):
        problems.append(f"the watchdog warned during the reclaim: {lent['warnings']}")
    print(json.dumps({k: v for k, v in report.items() if k != "lending"} | {"lending": {
        k: v for k, v in lent.items() if k != "owner"} | {"owner": {
            k: v for k, v in owner.items() if k != "ramp"}}}, indent=2))
    log(f"reclaim decided at the owner's measured peak {reclaim['decided_at_owner_peak_mib']} "
        f"MiB (trigger {reclaim['trigger_peak_mib']} MiB); SIGTERM -> checkpoint "
        f"{_s(reclaim['sigterm_to_checkpoint_s'])}, -> borrower gone "
        f"{_s(reclaim['sigterm_to_gone_s'])} (grace {reclaim['grace_s']:.0f} s)")
    log(f"owner: held {owner['held_mib']} of {owner['asked_up_to_mib']} MiB asked, "
        f"{owner['refused_allocations']} allocation(s) refused; most in use "
        f"{lent['most_used_mib']} of {lent['total_mib']} MiB")
    log(f"watchdog: rogue holding {dog['held_mib']} MiB of a {dog['grant_mib']} MiB grant "
        f"{'killed' if dog['killed'] else 'NOT killed'}; events: {dog['events']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for problem in problems:
        log(f"FAILED: {problem}")
    if report["device"] == "cpu":
        log("--device cpu: the logic ran; no GPU was measured")
    return 1 if problems else 0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
