"""`inmem-ft plan`: arguments, the report, the JSON block, the plot."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .. import argtypes, units
from ..errors import ConfigError
from ..units import human
from . import inputs, plan as planning
from .inputs import GB, Cluster, Costs, FailureModel, Job

PRESETS = ("llama3-405b",)
COST_FLAGS = ("blocking_s_per_gib", "commit_s_per_gib", "protect_s_per_gib", "restore_s_per_gib",
              "rebuild_s_per_gib", "detect_s", "restart_s", "hang_timeout_s", "spare_arrival_s", "shrink_extra_s")
PLOT_NODES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
KIND_HELP = {"node": "lose one node with its memory", "crash": "end the processes, the node's memory stays",
             "hang": "stall until the hang timeout", "correlated": "lose --correlated-nodes nodes at once"}


def _positive(kind):
    return argtypes.bounded(kind, "{text!r} must be > 0", above=0, not_a_number="{text!r} is not a number")


def _share(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share (0..1 or a percentage)") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1 (or 0% and 100%)")
    return value


_non_negative = argtypes.bounded(float, "{text!r} must be >= 0", minimum=0, not_a_number="{text!r} is not a number")


def add_arguments(p: argparse.ArgumentParser) -> None:
    pos, num, size = _positive(int), _positive(float), units.argparse_size
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="llama3-405b: Llama 3 405B on 2,048 nodes x 8 H100 (TP 8, PP 16, DP 128, 5.9 s steps, 54 "
                        "days), Llama 3's failure rate and causes, 2 TB/s storage; flags override (default: none)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=pos, help="nodes in the job (default: the preset's; required without one)")
    c.add_argument("--gpus-per-node", type=pos, help="GPUs (ranks) per node (default: the preset's; required without one)")
    c.add_argument("--host-memory", type=size, metavar="SIZE", help="host memory per node, to check the plan fits "
                                                                     "(default: not checked)")
    c.add_argument("--shm", type=size, metavar="SIZE", help="/dev/shm per node (default: not checked)")
    c.add_argument("--storage-gbps", type=num, help="shared storage bandwidth, GB/s, all nodes together "
                                                     "(default: 2000, Llama 3's 2 TB/s)")
    j = p.add_argument_group("job (a model, or --bytes-per-rank)")
    j.add_argument("--params", type=num, help="model parameters, e.g. 405e9 (default: the preset's)")
    j.add_argument("--tp", type=pos, default=None, help="tensor-parallel size (default: 1)")
    j.add_argument("--pp", type=pos, default=None, help="pipeline-parallel size (default: 1)")
    j.add_argument("--dp", type=pos, default=None, help="data-parallel size (default: GPUs / (TP x PP))")
    j.add_argument("--weights-per-replica", action="store_true",
                   help="every data-parallel replica snapshots its own copy of the weights (a Snapshotter without "
                        "dp_group) (default: stored once across data-parallel ranks, as the Megatron adapter does)")
    j.add_argument("--bytes-per-rank", type=size, metavar="SIZE",
                   help="snapshot bytes per rank, instead of --params, e.g. from `inmem-ft smp status` (default: from "
                        "the model)")
    j.add_argument("--checkpoint-bytes", type=size, metavar="SIZE",
                   help="a disk checkpoint's size (default: 14 bytes per parameter, else bytes per rank x ranks)")
    j.add_argument("--step-time-s", type=num, help="seconds per training step (default: the preset's; required "
                                                             "without one)")
    j.add_argument("--days", type=num, help="length of the run simulated (default: 54, Llama 3's snapshot)")
    f = p.add_argument_group("failures")
    f.add_argument("--node-mtbf-hours", type=num, help="mean hours between interruptions caused by one node "
                                                       "(default: Llama 3's, 6,335 h, with --preset or "
                                                       "--llama3-failures; required otherwise)")
    f.add_argument("--llama3-failures", action="store_true",
                   help="Llama 3's rate and causes: 419 unexpected interruptions, 54 days, 2,048 nodes (default: "
                        "with --preset)")
    for kind, default in (("node", "77%%"), ("crash", "12.9%%"), ("hang", "1.7%%"), ("correlated", "8.4%%")):
        f.add_argument(f"--share-{kind}", type=_share, metavar="SHARE",
                       help=f"share of interruptions that {KIND_HELP[kind]} (default: {default}, Llama 3)")
    f.add_argument("--correlated-nodes", type=pos, help="nodes lost together in a correlated failure (default: "
                                                        "2, a Llama 3 rack)")
    k = p.add_argument_group("our costs (default: built in, see docs/planning.md; --costs reads measured ones)")
    k.add_argument("--costs", action="append", default=[], metavar="JSON",
                   help="a result file of benchmarks/scaling.py or benchmarks/time_lost.py (--json): its measured "
                        "figures replace the defaults (repeatable)")
    for name in COST_FLAGS:
        k.add_argument("--" + name.replace("_", "-"), type=_non_negative, metavar="S",
                       help=f"default {getattr(Costs(), name):.3g}: {inputs.SOURCES[name]}".replace("%", "%%"))
    t = p.add_argument_group("targets and output")
    t.add_argument("--target-beyond-m", type=num, default=0.01, metavar="N",
                   help="expected losses of more than m nodes of a group over the run (default: %(default)s)")
    t.add_argument("--rebuild-share", type=num, default=0.001, metavar="SHARE",
                   help="share of the run rebuilds may take beyond the restarts they overlap; bigger groups need "
                        "less parity memory but rebuild slower (default: %(default)s)")
    t.add_argument("--max-disk-age", type=units.argparse_duration, default=3600.0, metavar="AGE",
                   help="flush to disk at least this often, e.g. 30m (default: 1h)")
    t.add_argument("--disk-interval-s", type=num, default=None,
                   help="checkpoint interval of the disk strategy compared (default: its Young/Daly optimum)")
    t.add_argument("--seeds", type=pos, default=20, help="simulated runs per strategy (default: %(default)s)")
    t.add_argument("--persist-dir", default="/shared/checkpoints/inmem_ft", metavar="DIR",
                   help="the disk tier's directory written into the block (default: %(default)s)")
    t.add_argument("--json", action="store_true", help="print the plan as JSON (default: a report)")
    t.add_argument("--plot", default=None, metavar="PNG",
                   help="draw effective training time vs cluster size for the strategies, needs matplotlib "
                        "(default: none)")


def resolve(args) -> tuple[Cluster, Job, FailureModel, Costs]:
    """The inputs from the arguments over the preset; a missing or inconsistent one is a ConfigError."""
    preset = args.preset == "llama3-405b"
    nodes = args.nodes or (inputs.LLAMA3_NODES if preset else None)
    gpus = args.gpus_per_node or (inputs.LLAMA3_GPUS_PER_NODE if preset else None)
    if nodes is None or gpus is None:
        raise ConfigError("give --nodes and --gpus-per-node (or --preset llama3-405b)")
    cluster = Cluster(nodes, gpus, args.host_memory, args.shm, args.storage_gbps or 2000.0)
    job = _job(args, preset, nodes * gpus)
    failures = _failures(args, preset)
    costs = inputs.costs_from_results(args.costs) if args.costs else Costs()
    costs = costs.with_values(**{name: getattr(args, name) for name in COST_FLAGS})
    return cluster, job, failures, costs


def _job(args, preset: bool, world: int) -> Job:
    if args.bytes_per_rank is not None and args.params is not None:
        raise ConfigError("give either --params (with --tp/--pp/--dp) or --bytes-per-rank, not both")
    model = dict(inputs.LLAMA3_405B) if preset else {}
    step_s = args.step_time_s or model.pop("step_s", None)
    if step_s is None:
        raise ConfigError("give --step-time-s, the seconds one training step takes (the interval is in steps)")
    extra = {"duration_days": args.days} if args.days else {}
    if args.bytes_per_rank is not None:
        return Job(args.bytes_per_rank, args.checkpoint_bytes or args.bytes_per_rank * world, step_s, **extra)
    for key in ("params", "tp", "pp", "dp"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    if "params" not in model:
        raise ConfigError("give the model (--params, with --tp/--pp/--dp) or --bytes-per-rank")
    tp, pp = model.get("tp", 1), model.get("pp", 1)
    dp = args.dp or world // (tp * pp)  # a preset's DP is for its own cluster size
    if tp * pp * dp != world:
        raise ConfigError(f"TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp} ranks, but the cluster has {world} GPUs")
    job = Job.from_model(model["params"], tp, pp, dp, step_s, weights_per_replica=args.weights_per_replica, **extra)
    if args.checkpoint_bytes:
        job = Job(job.bytes_per_rank, args.checkpoint_bytes, job.step_s, job.duration_days)
    return job


def _failures(args, preset: bool) -> FailureModel:
    shares = {k: getattr(args, f"share_{k}") for k in ("node", "crash", "hang", "correlated")}
    rate = 1.0 / args.node_mtbf_hours if args.node_mtbf_hours else None
    if preset or args.llama3_failures:
        if any(v is not None for v in shares.values()) and any(v is None for v in shares.values()):
            raise ConfigError("give all four --share-* values (they must add up to 1), or none")
        return inputs.llama3_failures(per_node_per_hour=rate, correlated_nodes=args.correlated_nodes, **shares)
    if rate is None:
        raise ConfigError("give --node-mtbf-hours (or --llama3-failures, or --preset llama3-405b)")
    if any(v is None for v in shares.values()):
        defaults = asdict(inputs.llama3_failures())
        shares = {k: defaults[k] if v is None else v for k, v in shares.items()}
    return FailureModel(rate, correlated_nodes=args.correlated_nodes or 2, **shares)


def make(args) -> tuple[planning.Plan, dict]:
    """The plan the arguments ask for and its inmem_ft block; a bad input is a ConfigError."""
    cluster, job, failures, costs = resolve(args)
    targets = planning.Targets(args.target_beyond_m, args.rebuild_share, args.max_disk_age, args.seeds)
    result = planning.make_plan(cluster, job, failures, costs, targets, disk_interval_s=args.disk_interval_s)
    return result, planning.config_block(result, args.persist_dir)


def run(args, error) -> int:
    """`error(message)` ends the command with one line and exit code 2 (argparse's parser.error)."""
    try:
        result, block = make(args)
    except ConfigError as e:
        error(str(e))
    if args.json:
        print(json.dumps(as_json(result, block), indent=1))
    else:
        print(report(result, block))
    if args.plot:
        try:
            draw(curves(result, args.disk_interval_s), args.plot)
        except ImportError:
            error("--plot needs matplotlib (pip install matplotlib)")
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def as_json(p: planning.Plan, block: dict) -> dict:
    return {"interval_steps": p.interval_steps, "interval_s": p.interval_s, "group_size": p.group_size,
            "parity": p.parity, "persist_every_steps": p.persist_every * p.interval_steps, "beyond_m_per_run": p.beyond_m_per_run,
            "memory": {"slots": p.memory.slots, "parity": p.memory.parity, "locked": p.memory.locked,
                       "shm": p.memory.shm, "replication": p.replication_memory},
            "job_mtbf_s": planning.job_mtbf_s(p.cluster, p.failures),
            "costs_s": planning.our_costs(p.cluster, p.job, p.costs, p.group_size, p.parity),
            "restart_s": p.restart.restart_s, "inmem_ft": block,
            "megatron_args": planning.megatron_args(p, "inmem_ft.json"),
            "strategies": [{**asdict(r), "interval_s": s.interval_s, "blocking_s": s.blocking_s}
                           for s, r in zip(p.strategies, p.results)]}


def report(p: planning.Plan, block: dict) -> str:
    c, j, f, k = p.cluster, p.job, p.failures, p.costs
    ours = planning.our_costs(c, j, k, p.group_size, p.parity)
    mtbf = planning.job_mtbf_s(c, f)
    node = p.node_bytes
    lines = [
        f"job: {c.nodes} nodes x {c.gpus_per_node} GPUs, {j.bytes_per_rank / GB:.2f} GB per rank "
        f"({node / GB:.1f} GB per node), a step every {j.step_s:g} s, {j.duration_days:g} days simulated",
        f"failures: one per node every {f.node_mtbf_hours:,.0f} h, one in the job every {mtbf / 3600:.2f} h; "
        f"node lost {f.node:.1%}, crash {f.crash:.1%}, hang {f.hang:.1%}, {f.correlated_nodes} nodes at once "
        f"{f.correlated:.1%}",
        "",
        "recommended:",
        f"  interval        {p.interval_steps} steps ({p.interval_s:.0f} s): Young/Daly sqrt(2 x blocking "
        f"{ours['blocking']:.3f} s x job MTBF {mtbf:.0f} s) = {planning.young_daly(ours['blocking'], mtbf):.0f} s, "
        f"at least the protection time {ours['protect']:.1f} s",
        f"  group, parity   G={p.group_size} nodes, m={p.parity} (parity {p.parity / (p.group_size - p.parity):.0%} "
        f"of a node's snapshot); losses of more than m in a group expected {p.beyond_m_per_run:.2g} times in the "
        f"run (target {p.targets.beyond_m_per_run:g}); each group's nodes must sit in different racks",
        f"  persist_every_steps {p.persist_every * p.interval_steps} ({p.persist_every} snapshots, "
        f"{p.persist_every * p.interval_s / 60:.0f} min): a flush of "
        f"every node takes {ours['flush']:.3g} s at {c.storage_gbps:g} GB/s",
        f"  memory per node /dev/shm {human(p.memory.shm)} = 2 slots x {human(node)} + parity 2 x {human(p.memory.parity / 2)}"
        f"; GPU jobs lock the slots ({human(p.memory.locked)}: ulimit -l); full replication would need "
        f"{human(p.replication_memory)} of /dev/shm",
        *("  " + line for line in planning.fits(p)),
        "",
        "costs at this size (s): " + ", ".join(f"{name} {v:.3g}" for name, v in ours.items())
        + f", restart {p.restart.restart_s:g}, detection {p.restart.detect_s:g}, hang timeout {p.restart.hang_timeout_s:g}",
        *(f"  {name}: {getattr(k, name):.4g} ({k.source(name)})" for name in inputs.SOURCES),
        "",
        f"effective training time over {j.duration_days:g} days ({p.targets.seeds} seeded runs each; mean, "
        f"5th-95th percentile):",
    ]
    rows = [("strategy", "effective", "5%-95%", "interval", "lost per failure", "memory/node", "where the rest went")]
    mem = {0: p.memory.shm, 1: 0.0, 2: p.replication_memory, 3: p.memory.shm}  # 3: shrink, the same snapshots
    for i, (s, r) in enumerate(zip(p.strategies, p.results)):
        rest = sorted(((v, name) for name, v in r.accounts.items() if name != "useful" and v > 0), reverse=True)
        rows.append((s.name, f"{r.effective:.2%}", f"{r.low:.2%}-{r.high:.2%}", f"{s.interval_s:.0f} s",
                     f"{r.lost_per_failure_s:.0f} s", human(mem[i]) if mem[i] else "-",
                     ", ".join(f"{name} {v:.2%}" for v, name in rest[:4])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += ["", "inmem_ft block (DeepSpeed config, or the file --inmem-ft-config names):",
              json.dumps({"inmem_ft": block}, indent=2), "",
              "Megatron: " + planning.megatron_args(p, "inmem_ft.json") + "   (the block above saved as inmem_ft.json)"]
    return "\n".join(lines)


def curves(p: planning.Plan, disk_interval_s: float | None) -> dict:
    """Effective training time (%) vs nodes for the strategies, everything else as in this plan: the same
    model and state per rank (more or fewer data-parallel replicas) on more or fewer nodes; with what `draw`
    needs to label them."""
    from dataclasses import replace

    sizes = sorted(set(n for n in PLOT_NODES if n <= 4 * p.cluster.nodes) | {p.cluster.nodes})
    series: dict[str, list[float]] = {}
    for n in sizes:
        sub = planning.make_plan(replace(p.cluster, nodes=n), p.job, p.failures, p.costs,
                                 replace(p.targets, seeds=max(5, p.targets.seeds // 4)),
                                 disk_interval_s=disk_interval_s)
        for s, r in zip(sub.strategies, sub.results):
            series.setdefault(s.name.split(" (")[0], []).append(r.effective * 100)
    return {"nodes": sizes, "effective_pct": series, "at_nodes": p.cluster.nodes,
            "gpus_per_node": p.cluster.gpus_per_node,
            "title": f"{p.job.bytes_per_rank / GB:.2f} GB per rank, one failure per node every "
                     f"{p.failures.node_mtbf_hours:,.0f} h, restart {p.restart.restart_s:g} s"}


def draw(data: dict, path: str) -> None:
    """The PNG of `curves`' result (what --plot writes, and benchmarks/plan_projection.py's plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    # Replication and EC often coincide (they differ in memory): dashed on top, so both show.
    for (name, values), style in zip(data["effective_pct"].items(), ("-o", "-s", "--^", ":v")):
        ax.plot(data["nodes"], values, style, label=name)
    ax.axvline(data["at_nodes"], color="#999", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"nodes ({data['gpus_per_node']} GPUs each)")
    ax.set_ylabel("effective training time (%)")
    ax.set_title(data["title"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
