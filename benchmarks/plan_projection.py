"""What `inmem-ft plan` projects for Llama 3 405B on 16,384 GPUs with the built-in costs (measured on this
project's machines, inmem_ft/planning/inputs.py): the plan and the effective training time of in-memory
erasure coding, disk checkpoints and full replication; how the restart time moves them; the plan with the
weights snapshotted per data-parallel replica; and effective training time against the cluster size.

    python benchmarks/plan_projection.py [--seeds N] [--json OUT] [--plot PNG]

A simulation, not a measurement of a cluster: the inputs are the costs measured here (their sources are in
the result file) and Llama 3's published failure rate and causes."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout

import report  # noqa: E402  benchmarks/report.py (the script's own folder is on sys.path)
from inmem_ft.planning import command, inputs  # noqa: E402
from inmem_ft.planning.plan import Targets  # noqa: E402

PRESET = ["--preset", "llama3-405b"]
RESTARTS_S = (10, 30, 60, 120, 300, 600)


def planned(args: list[str]) -> tuple:
    """The plan of `inmem-ft plan ARGS`, and its JSON (what --json prints)."""
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    plan, block = command.make(p.parse_args(args))
    return plan, {"command": " ".join(["inmem-ft", "plan", *args]), **command.as_json(plan, block)}


def effective(result: dict) -> dict[str, float]:
    """{strategy without its parameters (as `command.curves` names them): mean effective training time}."""
    return {s["strategy"].split(" (")[0]: s["effective"] for s in result["strategies"]}


def run(seeds: int) -> dict:
    seeded = [] if seeds == Targets().seeds else ["--seeds", str(seeds)]  # the command as a user types it
    with report.phase("the Llama 3 405B plan"):
        plan, base = planned(PRESET + seeded)
    c, j, f, k = plan.cluster, plan.job, plan.failures, plan.costs
    base["inputs"] = {
        "cluster": asdict(c), "job": asdict(j), "model": inputs.LLAMA3_405B,
        "failures": {**asdict(f), "node_mtbf_hours": f.node_mtbf_hours},
        "costs": {name: {"value": getattr(k, name), "source": k.source(name)} for name in inputs.SOURCES}}
    sensitivity = []
    for restart in RESTARTS_S:
        with report.phase(f"restart {restart} s"):
            _, r = planned(PRESET + seeded + ["--restart-s", str(restart)])
        sensitivity.append({"restart_s": restart, "group_size": r["group_size"], "parity": r["parity"],
                            "effective": effective(r)})
    with report.phase("weights per replica"):
        wide, per_replica = planned(PRESET + seeded + ["--weights-per-replica"])
    per_replica["bytes_per_rank"] = wide.job.bytes_per_rank
    with report.phase("effective training time vs cluster size"):
        curves = command.curves(plan, None)
    return {"seeds": seeds, "llama3": base, "restart_sensitivity": sensitivity,
            "weights_per_replica": per_replica, "curves": curves}


def plot(res: dict, path: str) -> None:
    command.draw(res["curves"], path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=Targets().seeds, help="simulated runs per strategy (default: %(default)s, as "
                                                          "inmem-ft plan)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    p.add_argument("--plot", metavar="PNG", help="draw effective training time vs cluster size here")
    args = p.parse_args(argv)
    res = run(args.seeds)
    rows = [{**r, "shares": ", ".join(f"{name} {v:.2%}" for name, v in r["effective"].items())}
            for r in res["restart_sensitivity"]]
    for line in report.table("effective training time vs restart time", [
            ("restart s", "{restart_s}"), ("G", "{group_size}"), ("m", "{parity}"), ("effective", "{shares}")], rows):
        print(line)
    report.write(res, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
