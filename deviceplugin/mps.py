"""The node's CUDA MPS control daemon: start it, check it, stop it.

One daemon per node serves every MPS client (per-client memory and SM limits come from the
clients' environment, see `sharing.py`). The plugin starts it unless one already answers on the
pipe directory (e.g. a separate DaemonSet container runs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


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
