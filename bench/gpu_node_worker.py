"""The process inside the job containers of `bench/gpu_node.py` (Python and PyTorch only).

Each mode prints progress lines and ends with one `RESULT {json}` line that the bench reads
from the pod's log:

  probe     what the container sees (UID, GPUs, MPS variables), a 10 GiB then a 6 GiB
            allocation; then `READY`, and once /tmp/go exists a bf16 matmul loop for
            --seconds (iterations and TFLOP/s)
  escape    changes its own environment before CUDA starts (--set K=V, --unset K), as a
            process inside a pod can, then tries each --ladder size (GiB) and times matmuls
  hog       raises its MPS memory limit, holds --gib GiB and sleeps (the watchdog's target)
  train     a training loop on the GPU that checkpoints on SIGTERM and resumes (carpool.workload)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GO_FILE = Path(tempfile.gettempdir()) / "carpool-go"  # `go` creates it: the timed part starts
N = 8192


def emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def seen() -> dict[str, Any]:
    """Who and what this process sees, before CUDA starts."""
    out: dict[str, Any] = {
        "uid": os.getuid(), "gid": os.getgid(),
        "dev_nvidia": sorted(p.name for p in Path("/dev").glob("nvidia*")),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("CUDA_", "NVIDIA_")) and k != "CUDA_MPS_LOG_DIRECTORY"},
    }
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30, check=False)
        out["nvidia_smi_L"] = (listed.stdout or listed.stderr).strip().splitlines()
    except OSError as error:
        out["nvidia_smi_L"] = [f"not runnable: {error.strerror}"]
    return out


def cuda_view(torch: Any) -> dict[str, Any]:
    try:
        count = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        return {"device_count": count, "devices": [
            {"name": p.name, "uuid": f"GPU-{p.uuid}",
             "memory_gib": round(p.total_memory / 2**30, 1)} for p in props]}
    except (RuntimeError, AssertionError) as error:
        return {"device_count": 0, "cuda_error": str(error).splitlines()[0][:200]}


def allocate(torch: Any, gib: int) -> str:
    try:
        block = torch.empty(gib * 1024**3, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        del block
        return "ok"
    except RuntimeError as error:  # torch.OutOfMemoryError, or a CUDA error under MPS
        return "refused: " + str(error).splitlines()[0][:120]
    finally:
        torch.cuda.empty_cache()


def matmul_loop(torch: Any, seconds: float) -> dict[str, Any]:
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.time()
    iterations = 0
    while time.time() - start < seconds:
        for _ in range(5):
            a @ b
        torch.cuda.synchronize()
        iterations += 5
    took = time.time() - start
    return {"iterations": iterations, "seconds": round(took, 3), "start": start,
            "end": start + took, "it_per_s": round(iterations / took, 2),
            "tflops": round(2 * N**3 * iterations / took / 1e12, 1)}


def import_torch(out: dict[str, Any]) -> Any:
    try:
        import torch
    except ImportError as error:  # an image without PyTorch (the bench's plumbing check)
        out |= {"device_count": 0, "cuda_error": f"no PyTorch: {error}"}
        return None
    out |= cuda_view(torch)
    return torch


def probe(args: argparse.Namespace) -> int:
    out = seen()
    torch = import_torch(out)
    if out["device_count"] == 0:
        emit(out)
        return 0
    for gib in args.try_gib:
        out[f"alloc_{gib}GiB"] = allocate(torch, gib)
    if args.seconds > 0:
        print("READY", flush=True)
        while not GO_FILE.exists():
            time.sleep(0.01)
        out["matmul"] = matmul_loop(torch, args.seconds)
    emit(out)
    return 0


def escape(args: argparse.Namespace) -> int:
    for pair in args.set:
        key, value = pair.split("=", 1)
        os.environ[key] = value
    for key in args.unset:
        os.environ.pop(key, None)
    out = seen()
    torch = import_torch(out)
    if out["device_count"] == 0:
        emit(out)
        return 0
    out["ladder"] = {f"{g}GiB": allocate(torch, g) for g in args.ladder}
    out["matmul"] = matmul_loop(torch, args.seconds)
    emit(out)
    return 0


def hog(args: argparse.Namespace) -> int:
    os.environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=140G"
    import torch

    block = torch.empty(args.gib * 1024**3, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    print(f"holding {args.gib} GiB (pid {os.getpid()})", flush=True)
    time.sleep(args.seconds)
    emit({"survived_s": args.seconds})
    return 0


def train(args: argparse.Namespace) -> int:
    """SGD on the GPU toward a fixed target; state (step, weights) saved on SIGTERM."""
    import torch

    from carpool import workload

    run = workload.current()
    run.install()
    torch.manual_seed(0)
    target = torch.randn(1024, 1024, device="cuda")
    step, weights = 0, torch.zeros(1024, 1024, device="cuda")
    if run.resume_from:
        state = torch.load(run.resume_from, map_location="cuda")
        step, weights = int(state["step"]), state["weights"]
        print(f"attempt={run.attempt} step={step} resumed from {run.resume_from} "
              f"on {torch.cuda.get_device_name(0)}", flush=True)
    checkpoint_dir = Path(run.checkpoint_dir or Path(tempfile.gettempdir()) / "ckpt")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    while step < args.steps:
        weights -= 0.01 * (weights - target)  # one gradient step on ||w - target||^2 / 2
        torch.cuda.synchronize()
        step += 1
        time.sleep(args.step_seconds)
        if run.stopping:
            path = checkpoint_dir / f"step-{step:06d}.pt"
            torch.save({"step": step, "weights": weights}, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
            recorded = run.report_checkpoint(str(path), progress=step / args.steps)
            loss = float(((weights - target) ** 2).mean())
            print(f"attempt={run.attempt} step={step} checkpoint {path} loss={loss:.6f} "
                  f"recorded={recorded}", flush=True)
            print(f"attempt={run.attempt} step={step} stopping on SIGTERM", flush=True)
            return 0
        if step % 20 == 0:
            run.report_progress(step / args.steps)
    loss = float(((weights - target) ** 2).mean())
    print(f"attempt={run.attempt} step={step} done loss={loss:.6f}", flush=True)
    emit({"attempt": run.attempt, "step": step, "loss": loss})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--try-gib", type=int, nargs="*", default=[10, 6])
    p.add_argument("--seconds", type=float, default=0)
    e = sub.add_parser("escape")
    e.add_argument("--set", action="append", default=[])
    e.add_argument("--unset", action="append", default=[])
    e.add_argument("--ladder", type=int, nargs="+", required=True)
    e.add_argument("--seconds", type=float, default=3)
    h = sub.add_parser("hog")
    h.add_argument("--gib", type=int, default=20)
    h.add_argument("--seconds", type=float, default=120)
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--step-seconds", type=float, default=0.1)
    sub.add_parser("go", help="start the timed part of the probe waiting in this container")
    args = parser.parse_args(argv)
    return {"probe": probe, "escape": escape, "hog": hog, "train": train,
            "go": go}[args.mode](args)


def go(args: argparse.Namespace) -> int:
    GO_FILE.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
