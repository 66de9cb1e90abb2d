"""Per-process GPU activity on a real GPU, as the device plugin's NVML backend reads it.

Idle interactive sessions are stopped only on what the plugin measured: NVML's per-process
utilization samples (`NvmlBackend.process_activity`), turned into each pod's
`lastActiveTime`. This runs two CUDA processes side by side on GPU 0, one multiplying
matrices and one holding memory and doing nothing, reads the backend every few seconds the
way the plugin's telemetry loop does, and prints what each process was seen doing: the busy
one must show SM use, the idle one none.

    python3 bench/gpu_activity.py [--seconds 20] [--json FILE]

Needs the `carpool` package importable, pynvml and torch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BUSY = ("import torch, time\n"
        "a = torch.randn(8192, 8192, device='cuda')\n"
        "end = time.time() + {seconds}\n"
        "while time.time() < end:\n"
        "    a @ a\n"
        "    torch.cuda.synchronize()\n")
IDLE = ("import torch, time\n"
        "held = torch.empty(1 << 28, device='cuda')\n"
        "torch.cuda.synchronize()\n"
        "time.sleep({seconds})\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from carpool.deviceplugin.backends.nvml import NvmlBackend

    backend = NvmlBackend()
    procs = {name: subprocess.Popen([sys.executable, "-c", code.format(seconds=args.seconds)])
             for name, code in (("busy", BUSY), ("idle", IDLE))}
    pids = {p.pid: name for name, p in procs.items()}
    seen: dict[str, list[int]] = {"busy": [], "idle": []}
    reads = 0
    try:
        backend.process_activity()  # the first read only sets where the next one starts
        end = time.monotonic() + args.seconds - 2
        while time.monotonic() < end:
            time.sleep(3)
            activity = backend.process_activity()
            reads += 1
            if activity is None:
                print("NVML answers no per-process utilization on this GPU", file=sys.stderr)
                return 2
            for sample in activity:
                if sample.pid in pids:
                    seen[pids[sample.pid]].append(sample.sm_pct)
            print(f"read {reads}: " + ", ".join(
                f"{pids.get(a.pid, a.pid)} {a.sm_pct}%" for a in activity), flush=True)
    finally:
        for p in procs.values():
            p.wait(timeout=args.seconds + 60)
        backend.close()
    result = {"reads": reads, "busy_samples": seen["busy"], "idle_samples": seen["idle"],
              "busy_seen": bool(seen["busy"]), "idle_seen": bool(seen["idle"])}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["busy_seen"] and not result["idle_seen"] else 1


if __name__ == "__main__":
    sys.exit(main())
