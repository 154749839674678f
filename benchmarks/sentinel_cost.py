"""What the check after a restore costs per training step, against the training step itself, side by side.

    python benchmarks/sentinel_cost.py --quick --json out/sentinel.json

One process trains a model of the shape benchmarks/snapshot_stall.py uses (Linear blocks with Adam, ~100M
parameters; --quick: ~8M) and times, in the same run:
  step_s            one forward/backward/Adam step
  observe_s         Sentinel.observe of the step's loss outside the screened steps (the tensor is only kept)
  observe_armed_s   Sentinel.observe within the screened steps after a restore (one .item() and the checks)
Medians; observe_per_step and observe_armed_per_step are their ratios to step_s.
"""
from __future__ import annotations

import argparse

import torch

import report  # benchmarks/report.py (the script's own folder is on sys.path)
from snapshot_stall import build_state, timed

from inmem_ft.capture.sentinel import Sentinel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~8M-parameter model and fewer repeats")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    hidden, layers, steps = (1024, 2, 5) if args.quick else (2048, 6, 10)
    model, opt, params = build_state(hidden, layers, torch.device("cpu"))
    x = torch.randn(8, hidden)
    last = {}

    def step():
        opt.zero_grad()
        last["loss"] = loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()

    step_s = timed(step, steps)
    quiet, armed = Sentinel(steps=0), Sentinel(steps=10 ** 9)
    armed.arm(0, [1.0] * 16)
    loss = last["loss"].detach()
    observe_s = timed(lambda: quiet.observe(1, loss), 2000)
    observe_armed_s = timed(lambda: armed.observe(1, loss, torch.tensor(1.0)), 2000)
    results = {"quick": args.quick, "params": params, "step_s": step_s, "observe_s": observe_s,
               "observe_armed_s": observe_armed_s, "observe_per_step": observe_s / step_s,
               "observe_armed_per_step": observe_armed_s / step_s}
    print(f"{params / 1e6:.0f}M parameters: step {step_s * 1e3:.1f} ms; observe {observe_s * 1e6:.1f} us "
          f"({results['observe_per_step']:.1e} of a step), screened {observe_armed_s * 1e6:.1f} us "
          f"({results['observe_armed_per_step']:.1e} of a step)")
    report.write(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
