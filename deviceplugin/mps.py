"""The node's CUDA MPS control daemon: start it, fence it, check it, stop it.

One daemon per node serves every MPS client. The limits in a client's environment (see
`sharing.py`) are only what an honest client keeps: a process may raise or drop its own
variables. The daemon's defaults are the fence: set before any MPS server starts, they bound
every client of that server whatever its environment (a client may lower them, never raise
them), and defaults set later do not reach a running server. So the plugin sets a per-GPU
*ceiling* right after the daemon answers and before it serves any Allocate: pinned memory and
active threads of `ceiling_pct` % of each GPU, the largest grant one MPS client may hold there
(placement refuses larger MPS grants on that GPU, see `core.placement`). Honest clients hold
their grant below it; a client that raises its variables gets at most the ceiling, and the
watchdog kills one that holds more memory than its grant (`agent.Watchdog`). A process that
skips MPS altogether is kept off the GPU only by the EXCLUSIVE_PROCESS compute mode, which the
chart's MPS daemon sets (docs/operations.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carpool.core.resources import mps_ceiling_mib as ceiling_mib

CONTROL = "nvidia-cuda-mps-control"


def mps_memory_limit(mib: int) -> str:
    """MPS's memory-limit syntax: whole GiB as "8G", otherwise "1536M"."""
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def ceiling_commands(ceiling_pct: int, gpus: Sequence[tuple[str, int]]) -> list[str]:
    """Control commands that fence every client at `ceiling_pct` % of each GPU ((uuid, MiB)).

    GPUs are named by UUID, which the control daemon accepts, so CUDA's device ordering
    cannot make a limit land on another GPU."""
    if not 1 <= ceiling_pct <= 100:
        raise ValueError(f"the MPS ceiling must be 1..100 %, got {ceiling_pct}")
    commands = [f"set_default_active_thread_percentage {ceiling_pct}"]
    commands += [f"set_default_device_pinned_mem_limit {uuid} "
                 f"{mps_memory_limit(ceiling_mib(total, ceiling_pct))}" for uuid, total in gpus]
    return commands


def parse_percentage(text: str) -> float:
    """`get_default_active_thread_percentage`'s answer ("50.0")."""
    return float(text.strip())


def parse_memory_limit(text: str) -> int:
    """`get_default_device_pinned_mem_limit`'s answer ("70G", "71885M", "" for none) in MiB."""
    value = text.strip()
    if not value:
        return 0
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    if value[-1].upper() in units:
        return int(float(value[:-1]) * units[value[-1].upper()])
    return int(value) // (1024 * 1024)


@dataclass
class MpsDaemon:
    pipe_dir: Path
    log_dir: Path
    binary: str = CONTROL

    def env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
                "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def available(self) -> bool:
        return shutil.which(self.binary) is not None

    def command(self, text: str, timeout_s: float = 10.0) -> str:
        """Send one control command (e.g. "get_server_list") and return its answer."""
        done = subprocess.run([self.binary], input=text + "\n", env=self.env(), text=True,
                              capture_output=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{self.binary} {text!r} failed ({done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip()

    def running(self) -> bool:
        if not (self.pipe_dir / "control").exists():
            return False
        try:
            self.command("get_server_list", timeout_s=5.0)
        except (RuntimeError, subprocess.TimeoutExpired, OSError):
            return False
        return True

    def fence(self, ceiling_pct: int, gpus: Sequence[tuple[str, int]]) -> None:
        """Set the per-GPU ceiling as the daemon's defaults; refuse if a server already runs
        (its clients would keep whatever defaults it started with)."""
        servers = self.command("get_server_list").split()
        if servers:
            raise RuntimeError(f"an MPS server (pid {', '.join(servers)}) already runs on "
                               f"{self.pipe_dir}; defaults set now would not reach it. Stop "
                               f"its clients and the daemon, then start again")
        for command in ceiling_commands(ceiling_pct, gpus):
            self.command(command)
        self.check_fence(ceiling_pct, gpus)

    def check_fence(self, ceiling_pct: int, gpus: Sequence[tuple[str, int]]) -> None:
        """Raise unless the daemon's defaults are at most the ceiling on every GPU (e.g. when
        another container runs the daemon)."""
        threads = parse_percentage(self.command("get_default_active_thread_percentage"))
        problems = [] if threads <= ceiling_pct else [f"active threads {threads:g} %"]
        for uuid, total in gpus:
            limit = parse_memory_limit(
                self.command(f"get_default_device_pinned_mem_limit {uuid}"))
            if limit == 0 or limit > ceiling_mib(total, ceiling_pct):
                problems.append(f"pinned memory on {uuid} {limit or 'unlimited'} MiB")
        if problems:
            raise RuntimeError(f"the MPS daemon on {self.pipe_dir} lets a client exceed the "
                               f"{ceiling_pct} % ceiling: {'; '.join(problems)}")

    def start(self, wait_s: float = 10.0) -> None:
        """Start the control daemon (`-d` forks into the background) unless one runs already."""
        if self.running():
            return
        if not self.available():
            raise RuntimeError(f"{self.binary} is not on PATH; MPS mode needs the CUDA driver's "
                               f"MPS tools on the node")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([self.binary, "-d"], env=self.env(), check=True, timeout=wait_s)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.running():
                return
            time.sleep(0.1)
        raise RuntimeError(f"MPS control daemon did not answer within {wait_s:.0f}s; "
                           f"see {self.log_dir / 'control.log'}")

    def stop(self) -> None:
        if self.running():
            self.command("quit")
