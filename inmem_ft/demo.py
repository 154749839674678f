"""The README's first command: a small GPT trained with DeepSpeed ZeRO-2 on 2 simulated nodes x 2 ranks
survives a killed rank and a lost node (recovered from memory and from its peer's erasure-coded parity),
and ends on exactly the losses of a run that never failed. Prints the timeline; plots out/demo.png."""
import os
import sys

from .launcher import scenario
from .launcher.supervisor import Failure

STEPS, INTERVAL = 300, 20


def main() -> int:
    work = os.path.abspath(os.environ.get("INMEM_FT_DEMO_DIR", "out/demo"))
    os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(work, "run"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    argv = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", str(STEPS),
            "--interval", str(INTERVAL)]
    failures = [Failure("rank", 110, 3), Failure("node", 230, 1)]
    print(f"inmem_ft demo: a small GPT, DeepSpeed ZeRO-2, 2 simulated nodes x 2 ranks, {STEPS} steps, a snapshot "
          f"every {INTERVAL}, erasure-coded across the nodes (m=1).\nFirst an uninterrupted reference run, then "
          f"the same run with: {'; '.join(f.describe() for f in failures)}.", flush=True)
    timeline = scenario.run(2, 2, "demo", 1 << 30, argv, failures, work, heartbeat_timeout_s=60, parity=1)
    print(scenario.verdict(timeline))
    print(scenario.time_lost(timeline))
    plot = os.path.join(os.path.dirname(work), "demo.png")
    scenario.plot(timeline, plot, "inmem_ft demo: GPT, DeepSpeed ZeRO-2, 2 nodes x 2 ranks")
    scenario.write_json(timeline, os.path.join(work, "timeline.json"))
    print(f"plot: {plot}\nlogs: {work}")
    return 0 if timeline.passed and timeline.matches_reference else 1


if __name__ == "__main__":
    sys.exit(main())
