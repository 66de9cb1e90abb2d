"""A training loop that survives preemption: it saves on SIGTERM and resumes where it stopped.

CPU only and standard library only: it fits y = 3x + 1 by stochastic gradient descent, one
small batch per step, so a step counter and two weights are the whole state. Run it under
Carpool (examples/checkpointing.yaml) or anywhere:

    python examples/train.py --steps 200 --step-seconds 0.1 --checkpoint-dir /tmp/ckpt

Under Carpool it learns from `carpool.workload` which attempt it is, where checkpoints live
and which one to resume from; on SIGTERM (preemption, maxDuration) it finishes the step it is
in, saves, reports the checkpoint and exits 0 before the grace period ends. Every line it
prints starts with the attempt and step, so `kubectl logs` shows the counter continuing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from carpool import workload


def save(directory: Path, step: int, weights: list[float]) -> Path:
    """Write the state aside, then rename it into place: a half-written file never counts."""
    path = directory / f"step-{step:06d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "weights": weights}))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def load(path: str) -> tuple[int, list[float]]:
    state = json.loads(Path(path).read_text())
    return int(state["step"]), [float(w) for w in state["weights"]]


def train_step(step: int, weights: list[float], rate: float = 0.05) -> float:
    """One SGD step on a batch drawn from the step's own seed (the same data on a rerun)."""
    rng = random.Random(step)
    batch = [(x, 3.0 * x + 1.0) for x in (rng.uniform(-1, 1) for _ in range(16))]
    grad_w = grad_b = loss = 0.0
    for x, y in batch:
        err = weights[0] * x + weights[1] - y
        grad_w += 2 * err * x / len(batch)
        grad_b += 2 * err / len(batch)
        loss += err * err / len(batch)
    weights[0] -= rate * grad_w
    weights[1] -= rate * grad_b
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step-seconds", type=float, default=0.1, help="simulated work per step")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--checkpoint-dir", type=Path, help="default: $CARPOOL_CHECKPOINT_DIR")
    args = p.parse_args(argv)

    run = workload.current()
    run.install()
    directory = args.checkpoint_dir or run.checkpoint_dir or Path("checkpoints")
    directory.mkdir(parents=True, exist_ok=True)
    step, weights = 0, [0.0, 0.0]
    if run.resume_from:
        step, weights = load(run.resume_from)

    def say(text: str) -> None:
        print(f"attempt={run.attempt} step={step} {text}", flush=True)

    say(f"resumed from {run.resume_from}" if run.resume_from else "starting fresh")

    while step < args.steps:
        loss = train_step(step, weights)
        time.sleep(args.step_seconds)
        step += 1
        if run.stopping or step % args.checkpoint_every == 0 or step == args.steps:
            path = save(directory, step, weights)
            recorded = run.report_checkpoint(path, progress=step / args.steps)
            say(f"checkpoint {path} loss={loss:.5f} recorded={recorded}")
            if run.stopping:
                left = run.seconds_left()
                say(f"stopping on SIGTERM with {left:.1f}s of grace left")
                return 0
        elif step % 10 == 0:
            run.report_progress(step / args.steps)
    say(f"done: w={weights[0]:.3f} b={weights[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
