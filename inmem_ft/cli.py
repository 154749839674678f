"""The `inmem-ft` command: run and inspect a node's SMP, and size the protection of a job."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import assets, units
from .argtypes import Parser, job_id, node_id
from ._version import __version__
from .planning import survival
from .planning import command as plan_command
from .cluster.options import ECOptions, add_ec_arguments, options_from_args, peer_argv
from .errors import ConfigError, InmemFTError, SMPUnavailable
from .smp import control, inventory, paths
from .smp.daemon import check_budget_fits
from .smp.diskargs import DEFAULT_KEEP, add_disk_arguments, resolve as resolve_disk
from .smp.metrics import add_metrics_arguments, metrics_argv
from .smp.segments import namespace

# Below this a budget holds the two slots of only a toy model's ranks: worth a warning, not an error.
SMALL_BUDGET = 1 << 30


def _node_args(p: argparse.ArgumentParser) -> None:
    # A string default goes through `type` as well: a bad $INMEM_FT_JOB or $INMEM_FT_NODE is the same one line.
    p.add_argument("--job", type=job_id, default=os.environ.get("INMEM_FT_JOB", "default"),
                   help="job id (default: $INMEM_FT_JOB, else 'default')")
    p.add_argument("--node", type=node_id, default=os.environ.get("INMEM_FT_NODE", "0"),
                   help="this node's index (default: $INMEM_FT_NODE, else 0)")
    p.add_argument("--socket", default=os.environ.get("INMEM_FT_SMP_SOCKET"),
                   help="control socket path (default: $INMEM_FT_SMP_SOCKET, else <runtime dir>/<job>/node<node>.sock)")


def _socket(args) -> str:
    return args.socket or paths.default_socket(args.job, args.node)


def apply_config_block(args) -> str | None:
    """Fill the SMP settings not given on the command line from the framework config's inmem_ft block,
    so the one block in the DeepSpeed JSON configures the trainers and the node daemons alike. Returns
    where the parity came from when the block asked for it (for the message if --nodes/--peers lack)."""
    from .config import InmemFTBlock

    try:
        with open(args.config) as f:
            config = json.load(f)
    except OSError as e:
        raise ConfigError(f"--config {args.config}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"--config {args.config} is not valid JSON: {e}") from None
    block = InmemFTBlock.from_framework_config(config)
    if block is None:
        raise ConfigError(f"{args.config} has no \"inmem_ft\" block")
    if args.memory_budget is None:
        args.memory_budget = block.memory_budget
    if args.persist_dir is None:
        args.persist_dir = block.persist_dir
    if args.persist_every_steps is None and block.persist:
        args.persist_every_steps = block.persist_every_steps
    if args.persist_keep is None:
        args.persist_keep = block.persist_keep
    if block.job and args.job == "default":
        args.job = block.job
    if args.parity is None and block.parity:
        args.parity, args.group_size = block.parity, args.group_size or block.group_size
        return f"{args.config} (\"parity\": {block.parity}, \"group_size\": {block.group_size})"
    return None


def cmd_smp_start(args) -> int:
    resolve_disk(args)
    asked_by = apply_config_block(args) if args.config else None
    if args.memory_budget is None:
        raise ConfigError("give --memory-budget, or --config with a memory_budget in its inmem_ft block")
    ec = options_from_args(args, asked_by or "--parity")
    check_budget_fits(args.memory_budget, args.job, args.node)
    if args.memory_budget < SMALL_BUDGET:
        print(f"inmem-ft: warning: a memory budget of {units.human(args.memory_budget)} holds two snapshots "
              f"of only {units.human(args.memory_budget / 2)} for all of this node's ranks together; the first "
              f"snapshot fails if they need more", file=sys.stderr)
    extra = ec.argv() if ec else peer_argv(args)
    if args.persist_dir:
        extra += ["--persist-dir", os.path.abspath(args.persist_dir), "--persist-every-steps",
                  str(args.persist_every_steps or 0), "--persist-keep",
                  str(DEFAULT_KEEP if args.persist_keep is None else args.persist_keep)]
    extra += metrics_argv(args)
    proc = control.start(args.job, args.node, args.memory_budget, _socket(args), args.log, extra_args=extra)
    print(f"inmem-ft: SMP for job {args.job} node {args.node} running as pid {proc.pid} on {_socket(args)}"
          f"{'' if ec is None else f', erasure coding with m={ec.parity} across {ec.nodes} nodes'}")
    return 0


def cmd_smp_stop(args) -> int:
    socket = _socket(args)
    if control.ping(socket) is None:
        # Nothing to stop; --wipe still frees what a dead or stopped SMP left in /dev/shm.
        print(f"inmem-ft: no SMP is running on {socket}; nothing to stop")
        if args.wipe:
            count, size = inventory.remove(args.job, args.node)
            print(f"inmem-ft: wiped {count} segment(s) of job {args.job} node {args.node} from shared memory "
                  f"({units.human(size)})")
        return 0
    control.stop(socket, wipe=args.wipe)
    print(f"inmem-ft: SMP on {socket} stopped{' and its snapshots wiped' if args.wipe else ''}")
    return 0


def _or(value, text: str = "none yet") -> str:
    """A step, age or lag, or what its absence means: never "None"."""
    return text if value is None else str(value)


def _lag(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def format_status(status: dict) -> str:
    held, age = status["held_step"], status["held_age_s"]
    counts = status["counters"]
    lines = [f"job {status['job']}  node {status['node']}  pid {status['pid']}  up {status['uptime_s']} s",
             f"memory  {units.human(status['used'])} used of {units.human(status['budget'])} budget",
             f"newest step held by every rank of this node: {_or(held)}"
             f"{'' if age is None else f' (committed {format_age(age)} ago)'}",
             f"newest step the trainers reported complete on every rank of the job: {_or(status['complete_step'])}",
             f"since start: {counts['commits']} commits, {counts['skipped']} snapshots skipped, {counts['torn']} "
             f"torn and {counts['corrupt']} corrupt slots discarded, {counts['sentinel_trips']} sentinel trips, "
             f"{counts['replica_mismatches']} replica mismatches",
             f"steps found bad (never restored again): "
             f"{', '.join(map(str, status['bad_steps'])) or 'none'}",
             f"{'rank':>6} {'slot':>4} {'state':<10} {'step':>8} {'bytes':>12}"]
    for rank in status["ranks"]:
        for slot in rank["slots"]:
            lines.append(f"{rank['rank']:>6} {slot['slot']:>4} {slot['state']:<10} "
                         f"{_or(slot['step'], '-'):>8} {units.human(slot['bytes']):>12}")
    ec = status["ec"]
    if ec:
        lines.append(f"erasure coding: group {ec['group'] or 'none (too few nodes left)'}, survives {ec['m']} lost "
                     f"node(s) per group; newest protected "
                     f"step {_or(ec['protected_step'])}; EC lag {_lag(ec['ec_lag_s'])}; parity "
                     f"{units.human(ec['parity_bytes'])}; rebuild {ec['rebuild']}, {ec['rebuilds']} done"
                     + (f"; DEGRADED: {ec['degraded']}" if ec["degraded"] else ""))
    disk = status["disk"]
    lines.append("disk tier: off (no --persist-dir)" if not disk else
                 f"disk tier: {disk['dir']}; newest step flushed {_or(disk['flushed_step'])}; flush lag "
                 f"{_lag(disk['flush_lag_s'])}; {disk['flush_failures']} failed flushes")
    links = status["peers"]
    lines.append("peer links: none (no --peers)" if not links else "peer links (how the last call went): " +
                 ", ".join(f"node {p['node']} {p['addr']} {p['state']}" for p in links))
    return "\n".join(lines)


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def format_stale(rows: list[dict]) -> str:
    if not rows:
        return "segments no running SMP serves: none"
    lines = [f"segments no running SMP serves (kept for a re-queue, or left by a job whose SMP died), in "
             f"{namespace()}; `inmem-ft smp clean` removes them:",
             f"{'job':<24} {'node':>4} {'files':>5} {'bytes':>12} {'last written':>14} {'complete step':>13}"]
    for r in rows:
        step = "-" if r["complete_step"] is None else r["complete_step"]
        lines.append(f"{r['job']:<24} {r['node']:>4} {r['files']:>5} {units.human(r['bytes']):>12} "
                     f"{format_age(r['age_s']) + ' ago':>14} {step:>13}")
    return "\n".join(lines)


def cmd_smp_status(args) -> int:
    try:
        status = control.status(args.job, args.node, _socket(args))
    except SMPUnavailable:
        # Still show what is left in shared memory: with no SMP running, that is what an operator asks about.
        stale = inventory.stale_rows()
        print(json.dumps({"stale": stale}, indent=2) if args.json else format_stale(stale))
        raise
    print(json.dumps(status, indent=2) if args.json else format_status(status) + "\n" + format_stale(status["stale"]))
    return 0


def cmd_smp_flush(args) -> int:
    found = control.flush(args.job, args.node, _socket(args), args.timeout)
    nodes = ", ".join(f"node {n}: step {s}" for n, s in found["nodes"].items())
    print(f"inmem-ft: step {found['step']}, the newest complete step of job {args.job}, is on disk on every node "
          f"({nodes})")
    return 0


def cmd_smp_clean(args) -> int:
    if args.job is None and args.older_than is None and not args.all:
        raise ConfigError("say what to remove: --job J, --older-than 2h, or --all (every job's segments that no "
                          "running SMP serves)")
    now, removed = time.time(), 0
    for group in inventory.stale(args.job, args.older_than):
        if args.node is not None and group.node != args.node:
            continue
        try:
            count, size = inventory.remove(group.job, group.node)
        except SMPUnavailable as e:  # an SMP started for it since we looked
            print(f"inmem-ft: kept job {group.job} node {group.node}: {e}")
            continue
        removed += 1
        print(f"inmem-ft: removed {count} segment(s) of job {group.job} node {group.node} ({units.human(size)}, "
              f"last written {format_age(now - group.last_write)} ago)")
    if not removed:
        print("inmem-ft: no segments to remove: none that no running SMP serves matches")
    for group in inventory.holdings():
        if group.pid is not None and group.job == args.job and args.node in (None, group.node):
            print(f"inmem-ft: kept job {group.job} node {group.node}: its SMP (pid {group.pid}) is running; "
                  f"`inmem-ft smp stop --job {group.job} --node {group.node} --wipe` removes them")
    return 0


def cmd_inspect(args) -> int:
    from .smp.client import SMPClient
    from .snapshot import catalog

    client = SMPClient(_socket(args))
    try:
        listing = client.catalog()  # every step held: an error for a missing --step can say which are
    finally:
        client.close()
    if listing["unreachable"]:
        lost = "; ".join(f"node {u['node']}: {u['error']}" for u in listing["unreachable"])
        raise InmemFTError(f"unreachable: {lost}")
    step = catalog.complete_step(listing["entries"], args.step)
    table = catalog.fragments(listing["entries"], step)
    keys = catalog.check(table)
    first = min((e for e in listing["entries"] if e["step"] == step), key=lambda e: e["rank"])
    topology = first["manifest"].get("topology", {})
    if args.json:
        print(json.dumps({"job": args.job, "step": step, "topology": topology, "coverage": keys,
                          "fragments": table.to_pylist()}, indent=1))
        return 0
    print(format_inspect(args.job, step, topology, keys, table.to_pylist()))
    return 0


def format_inspect(job: str, step: int, topology: dict, keys: list[dict], rows: list[dict]) -> str:
    sizes = " ".join(f"{n}={topology.get(n)}" for n in ("world_size", "tp", "pp", "dp", "ep", "vpp"))
    lines = [f"job {job}  step {step} (held for every rank)",
             f"topology: framework {topology.get('framework')} {topology.get('framework_version') or ''}  {sizes}  "
             f"zero_stage {topology.get('zero_stage')}",
             "", f"{'key':<40} {'dtype':<9} {'global shape':<18} {'main':>5} {'rows':>5}  coverage"]
    for k in keys:
        lines.append(f"{k['key']:<40} {k['dtype']:<9} {str(tuple(k['global_shape'])):<18} {k['main_rows']:>5} "
                     f"{k['rows']:>5}  exact")
    lines += ["", f"{'key':<32} {'box (offset+shape)':<26} {'flat':<14} {'main':<5} {'replica':<8} {'node':>4} "
                  f"{'rank':>5} {'slot offset':>12} {'bytes':>10} {'of fragment bytes':<20} {'source':<6}"]
    for r in rows:
        box = f"{tuple(r['offset'])}+{tuple(r['shape'])}"
        part = f"[{r['frag_byte_lo']}, {r['frag_byte_lo'] + r['nbytes']})"  # a DP share may hold part of one
        lines.append(f"{r['key']:<32} {box:<26} {str((r['flat_lo'], r['flat_hi'])):<14} {str(r['main']):<5} "
                     f"{str(tuple(r['replica'])):<8} {r['node']:>4} {r['rank']:>5} {r['slot_offset']:>12} "
                     f"{r['nbytes']:>10} {part:<20} {r['source']:<6}")
    return "\n".join(lines)


def cmd_export(args) -> int:
    from .export import export

    if args.from_dir:
        from .universal.diskslots import DiskSlots

        slots, what = DiskSlots(args.from_dir), f"the disk tier in {args.from_dir}"
    else:
        slots, what = _socket(args), f"job {args.job}"
    done = export(slots, args.format, args.out, args.step, progress=not args.quiet)
    print(f"inmem-ft: exported step {done['step']} of {what} as {done['format']} to {done['path']}: "
          f"{done['tensors']} global tensors, {units.human(done['bytes'])}, {done['seconds']:.1f} s")
    return 0


def cmd_launch(args) -> int:
    from .launcher import scenario
    from .launcher.supervisor import Failure

    argv = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not argv:
        raise ConfigError("give the training command after --, e.g. -- train.py --steps 100")
    failures = ([Failure.parse("rank", s) for s in args.kill_rank] +
                [Failure.parse("node", s) for s in args.kill_node] + [Failure.parse("hang", s) for s in args.hang_rank])
    if args.parity:
        try:
            ECOptions(args.parity, args.nodes, "", args.group_size).groups()
        except ValueError as e:
            raise ConfigError(f"--parity {args.parity} --nodes {args.nodes}: {e}") from None
    work_dir = os.path.abspath(args.work_dir)
    os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(work_dir, "run"))
    timeline = scenario.run(args.nodes, args.ranks_per_node, args.job, args.memory_budget, argv, failures,
                            work_dir, compare=not args.no_compare, heartbeat_timeout_s=args.heartbeat_timeout,
                            max_restarts=args.max_restarts, parity=args.parity, group_size=args.group_size,
                            standby=not args.no_standby)
    print(scenario.verdict(timeline))
    if timeline.time_lost:
        print(scenario.time_lost(timeline))
    scenario.write_json(timeline, os.path.join(work_dir, "timeline.json"))
    if args.plot:
        scenario.plot(timeline, args.plot, f"{args.nodes} nodes x {args.ranks_per_node} ranks")
        print(f"plot: {args.plot}")
    return 0 if timeline.passed else 1


def cmd_print_file(args) -> int:
    path = args.lookup(args.name)
    if args.path:
        print(path)
    else:
        with open(path) as f:
            sys.stdout.write(f.read())
    return 0


def _file_command(sub, name: str, lookup, names, help: str) -> None:
    p = sub.add_parser(name, help=help)
    p.add_argument("name", choices=sorted(names), help="which one")
    p.add_argument("--path", action="store_true",
                   help="print where the installed file is instead of its text (default: the text)")
    p.set_defaults(fn=cmd_print_file, lookup=lookup)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="inmem-ft", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    smp = sub.add_parser("smp", help="the node's snapshot management process").add_subparsers(
        dest="smp_command", required=True)
    start = smp.add_parser("start", help="start the node's SMP in the background")
    _node_args(start)
    start.add_argument("--memory-budget", type=units.argparse_size, default=None, metavar="SIZE",
                       help="shared memory the SMP may use for every local rank's two slots, e.g. 64GiB "
                            "(default: the config's memory_budget)")
    start.add_argument("--config", default=None, metavar="JSON",
                       help="a DeepSpeed config: memory_budget, parity, group_size and persist_* keys of its inmem_ft "
                            "block fill in what the command line leaves out (default: none)")
    start.add_argument("--log", default=None, metavar="PATH", help="log file (default: beside the socket)")
    add_disk_arguments(start, from_env=True, from_config=True)
    add_ec_arguments(start)
    add_metrics_arguments(start)
    start.set_defaults(fn=cmd_smp_start)
    stop = smp.add_parser("stop", help="stop the node's SMP")
    _node_args(stop)
    stop.add_argument("--wipe", action="store_true",
                      help="also delete its snapshots from shared memory, also when no SMP is running (default: keep)")
    stop.set_defaults(fn=cmd_smp_stop)
    status = smp.add_parser("status", help="show the SMP's slots, steps and memory, and the segments no running "
                                           "SMP serves")
    _node_args(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON (default: a table)")
    status.set_defaults(fn=cmd_smp_status)
    flush = smp.add_parser("flush", help="write the job's newest complete step to the disk tier on every node now "
                                         "(before planned maintenance); returns once it is there, else says why "
                                         "not with exit code 1")
    _node_args(flush)
    flush.add_argument("--timeout", type=units.argparse_duration, default=600.0, metavar="DURATION",
                       help="give up after this long, e.g. 90s, 10m (default: 10m)")
    flush.set_defaults(fn=cmd_smp_flush)
    clean = smp.add_parser("clean", help="remove segments that no running SMP serves (stopped or dead SMPs' "
                                         "snapshots), also with no SMP running")
    clean.add_argument("--job", type=job_id, default=None, help="only this job's (default: every job's)")
    clean.add_argument("--node", type=node_id, default=None, help="only this node's (default: every node's)")
    clean.add_argument("--older-than", type=units.argparse_duration, default=None, metavar="AGE",
                       help="only those last written at least AGE ago, e.g. 90s, 30m, 2h, 7d (default: any age)")
    clean.add_argument("--all", action="store_true",
                       help="every job's, when neither --job nor --older-than narrows it (default: one of the "
                            "three is required)")
    clean.set_defaults(fn=cmd_smp_clean)

    inspect = sub.add_parser("inspect", help="every fragment of every rank of a step, where its bytes live "
                                             "(any node, or parity for a lost one) and whether each tensor is covered")
    _node_args(inspect)
    inspect.add_argument("--step", type=int, default=None,
                         help="the step to list (default: the newest step held for every rank)")
    inspect.add_argument("--json", action="store_true", help="print the catalog as JSON (default: tables)")
    inspect.set_defaults(fn=cmd_inspect)

    export = sub.add_parser("export", help="write a step held in memory (any node's, parity for a lost one) or "
                                           "flushed to disk as a checkpoint stock tools load, one global tensor at "
                                           "a time")
    _node_args(export)
    export.add_argument("--step", type=int, default=None,
                        help="the step to export (default: the newest step held for every rank)")
    export.add_argument("--format", required=True, choices=["deepspeed-universal", "megatron-dist", "torch-dcp"],
                        help="deepspeed-universal: what ds_to_universal writes, for \"load_universal\": true at "
                             "ZeRO-1/2/3 on any DP size; megatron-dist: a torch_dist checkpoint Megatron's --load "
                             "reads on any TP/PP layout; torch-dcp: torch.distributed.checkpoint of every global "
                             "tensor (of a snapshot inmem_ft.dcp wrote: the checkpoint its DCP save described) "
                             "(required)")
    export.add_argument("--from", dest="from_dir", metavar="DIR", default=None,
                        help="read the step from the SMPs' disk tier (their persist_dir, a job's folder in it or "
                             "one node's), verified, instead of from the SMPs; no SMP needs to run (default: from memory)")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory, created if missing (required)")
    export.add_argument("--quiet", action="store_true", help="no progress bar (default: one on stderr)")
    export.set_defaults(fn=cmd_export)

    # Listed here for --help; main() hands `run`'s arguments to torchrun's parser (agent/run.py) untouched.
    sub.add_parser("run", add_help=False, help="torchrun with inmem_ft's agent: starts the node's SMP, restarts "
                                               "failed or hung ranks, reports the time each failure cost "
                                               "(`inmem-ft run --help`)")

    launch = sub.add_parser("launch", help="run a job on simulated nodes on this machine, inject failures, "
                                           "recover, and print the timeline")
    launch.add_argument("--nodes", type=int, default=2, help="simulated nodes (default: %(default)s)")
    launch.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default: %(default)s)")
    launch.add_argument("--job", type=job_id, default="launch", help="job id (default: %(default)s)")
    launch.add_argument("--memory-budget", type=units.argparse_size, default="2GiB", metavar="SIZE",
                        help="each node's SMP memory budget (default: 2GiB)")
    launch.add_argument("--parity", type=int, default=None, metavar="M",
                        help="erasure-code the snapshots across nodes, surviving M lost nodes per group "
                             "(default: off)")
    launch.add_argument("--group-size", type=int, default=None, metavar="G",
                        help="nodes per EC group, G = k + m (k data, m = --parity) (default: largest divisor "
                             "of --nodes <= 8)")
    launch.add_argument("--kill-rank", action="append", default=[], metavar="STEP:RANK",
                        help="kill -9 RANK once it reaches STEP (repeatable; default: none)")
    launch.add_argument("--kill-node", action="append", default=[], metavar="STEP:NODE",
                        help="lose NODE (its ranks, its SMP and its memory) once it reaches STEP (repeatable; "
                             "default: none)")
    launch.add_argument("--hang-rank", action="append", default=[], metavar="STEP:RANK",
                        help="freeze RANK (SIGSTOP) at STEP; the heartbeat timeout must catch it (repeatable; "
                             "default: none)")
    launch.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a rank silent this long is hung, and all ranks restart (default: %(default)s)")
    launch.add_argument("--no-standby", action="store_true",
                        help="start every rank of a restart as a fresh process; needed by a command that must "
                             "do something before an import (default: keep one warm standby process per rank that "
                             "has already imported what the rank imports, and hand it the rank at a restart)")
    launch.add_argument("--max-restarts", type=int, default=5,
                        help="restarts before giving up (default: %(default)s)")
    launch.add_argument("--no-compare", action="store_true",
                        help="skip the uninterrupted reference run (default: run it and compare losses)")
    launch.add_argument("--work-dir", default="inmem_ft_launch", metavar="DIR",
                        help="logs, loss log, timeline.json; a run replaces what an earlier one left there "
                             "(default: %(default)s)")
    launch.add_argument("--plot", default=None, metavar="PNG",
                        help="loss vs step with failures, restores and time lost marked (default: none)")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, help="-- train.py [args...]")
    launch.set_defaults(fn=cmd_launch)

    surv = sub.add_parser("survival", help="probability that an in-memory snapshot is lost, EC vs replication")
    survival.add_survival_arguments(surv)
    surv.set_defaults(fn=survival.run_survival)

    plan = sub.add_parser("plan", help="recommend the snapshot interval, EC group, parity, disk-tier cadence and "
                                       "memory for a cluster's failure rate, and simulate the effective training "
                                       "time against disk checkpoints and full replication")
    plan_command.add_arguments(plan)
    plan.set_defaults(fn=lambda args: plan_command.run(args, plan.error))

    _file_command(sub, "launch-script", assets.launch_script, assets.LAUNCH_SCRIPTS,
                  "print a launch script shipped with inmem_ft: torchrun (one node: its SMP and torchrun with "
                  "restarts) or slurm (an sbatch job running the torchrun one on every node), e.g. "
                  "inmem-ft launch-script slurm > job.sbatch")
    _file_command(sub, "example-config", assets.example_config, assets.EXAMPLE_CONFIGS,
                  "print an example config with an inmem_ft block: deepspeed (ZeRO-2; also deepspeed-zero1/2/3) "
                  "or megatron (for --inmem-ft-config)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from .agent.run import main as run_main

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (InmemFTError, PermissionError) as e:
        print(f"inmem-ft: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
