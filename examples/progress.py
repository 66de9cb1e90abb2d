"""Progress reports from a training loop: one line, and the jobs waiting behind this one get
estimates that follow its real rate.

Standard library only, CPU only: a loop of `--steps` steps with an evaluation every
`--eval-every` steps. Under Carpool the reports land in the GpuJob's `status.progress`;
anywhere else they are dropped and the loop runs the same:

    python examples/progress.py --steps 300 --step-seconds 0.05

The same line for the training frameworks (each imported only when its callback is used):

    trainer = lightning.Trainer(..., callbacks=[workload.LightningCallback()])
    trainer = transformers.Trainer(..., callbacks=[workload.HuggingFaceCallback()])
"""

from __future__ import annotations

import argparse
import sys
import time

from carpool import workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--start", type=int, default=0, help="resume at this step")
    p.add_argument("--step-seconds", type=float, default=0.05, help="simulated work per step")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-seconds", type=float, default=1.0)
    p.add_argument("--report-every", type=float, default=workload.REPORT_EVERY_S,
                   help="seconds between progress reports, at most (%(default)s)")
    args = p.parse_args(argv)

    progress = workload.Progress(args.steps, args.start, every_s=args.report_every)
    for step in range(args.start + 1, args.steps + 1):
        time.sleep(args.step_seconds)  # one training step
        progress.update(step)
        if step % args.eval_every == 0 and step < args.steps:
            with progress.pause("eval"):  # not a slower rate: a pause
                time.sleep(args.eval_seconds)
    # the plain form, when nothing in the loop pauses:
    #     for step in workload.steps(range(args.start, args.steps)): ...
    print(f"done: {progress.step} of {progress.total} steps, paused {progress.paused_s:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
