"""The README's first command: a small job on simulated nodes survives failures and ends on exactly the
losses of a run that never failed. Prints the timeline and writes a plot to out/demo.png."""
import os
import sys

from .launcher import scenario
from .launcher.supervisor import Failure


def main() -> int:
    work = os.path.abspath(os.environ.get("INMEM_FT_DEMO_DIR", "out/demo"))
    os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(work, "run"))
    argv = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", "40", "--interval", "5"]
    failures = [Failure("rank", 12, 3), Failure("hang", 27, 1)]
    print("inmem_ft demo: 2 simulated nodes x 2 ranks; an uninterrupted reference run first, then the same run "
          "with rank 3 killed at step 12 and rank 1 hung at step 27", flush=True)
    timeline = scenario.run(2, 2, "demo", 1 << 30, argv, failures, work, heartbeat_timeout_s=10)
    print(timeline.format())
    print(scenario.verdict(timeline))
    plot = os.path.join(os.path.dirname(work), "demo.png")
    scenario.plot(timeline, plot, "inmem_ft demo: 2 nodes x 2 ranks")
    scenario.write_json(timeline, os.path.join(work, "timeline.json"))
    print(f"plot: {plot}")
    return 0 if timeline.ok and timeline.matches_reference else 1


if __name__ == "__main__":
    sys.exit(main())
