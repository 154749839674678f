"""The `inmem-ft` command: run and inspect a node's SMP, and size the protection of a job."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import units
from .cluster import survival
from .cluster.options import add_ec_arguments, options_from_args
from .errors import ConfigError, InmemFTError
from .smp import control, paths


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=os.environ.get("INMEM_FT_JOB", "default"), help="job id (default: %(default)s)")
    p.add_argument("--node", type=int, default=int(os.environ.get("INMEM_FT_NODE", "0")),
                   help="this node's index (default: %(default)s)")
    p.add_argument("--socket", default=os.environ.get("INMEM_FT_SMP_SOCKET"),
                   help="control socket path (default: <runtime dir>/<job>/node<node>.sock)")


def _socket(args) -> str:
    return args.socket or paths.default_socket(args.job, args.node)


def apply_config_block(args) -> None:
    """Fill the SMP settings not given on the command line from the framework config's inmem_ft block,
    so the one block in the DeepSpeed JSON configures the trainers and the node daemons alike."""
    from .config import InmemFTBlock

    with open(args.config) as f:
        block = InmemFTBlock.from_framework_config(json.load(f))
    if block is None:
        raise ConfigError(f"{args.config} has no \"inmem_ft\" block")
    if args.memory_budget is None:
        args.memory_budget = block.memory_budget
    if args.spill_dir is None:
        args.spill_dir = block.spill_dir
    if args.parity is None and block.parity:
        args.parity, args.group_size = block.parity, args.group_size or block.group_size
    if block.job and args.job == "default":
        args.job = block.job


def cmd_smp_start(args) -> int:
    if args.config:
        apply_config_block(args)
    if args.memory_budget is None:
        raise ConfigError("give --memory-budget, or --config with a memory_budget in its inmem_ft block")
    ec = options_from_args(args)
    extra = ec.argv() if ec else []
    if args.spill_dir:
        extra += ["--spill-dir", os.path.abspath(args.spill_dir)]
    proc = control.start(args.job, args.node, args.memory_budget, _socket(args), args.log, extra_args=extra)
    print(f"inmem-ft: SMP for job {args.job} node {args.node} running as pid {proc.pid} on {_socket(args)}")
    return 0


def cmd_smp_stop(args) -> int:
    control.stop(_socket(args), wipe=args.wipe)
    print(f"inmem-ft: SMP on {_socket(args)} stopped{' and its snapshots wiped' if args.wipe else ''}")
    return 0


def format_status(status: dict) -> str:
    lines = [f"job {status['job']}  node {status['node']}  pid {status['pid']}  up {status['uptime_s']} s",
             f"memory  {units.human(status['used'])} used of {units.human(status['budget'])} budget",
             f"newest step complete on every rank: {status['complete_step']}",
             f"{'rank':>6} {'slot':>4} {'state':<10} {'step':>8} {'bytes':>12}"]
    for rank in status["ranks"]:
        for slot in rank["slots"]:
            lines.append(f"{rank['rank']:>6} {slot['slot']:>4} {slot['state']:<10} "
                         f"{'' if slot['step'] is None else slot['step']:>8} {units.human(slot['bytes']):>12}")
    ec = status.get("ec")
    if ec:
        lag = "-" if ec["ec_lag_s"] is None else f"{ec['ec_lag_s']:.2f} s"
        lines.append(f"erasure coding: group {ec['group']}, survives {ec['m']} lost node(s); newest protected "
                     f"step {ec['protected_step']}; EC lag {lag}; parity {units.human(ec['parity_bytes'])}; "
                     f"rebuild {ec['rebuild']}")
    return "\n".join(lines)


def cmd_smp_status(args) -> int:
    status = control.call(_socket(args), "status")
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_launch(args) -> int:
    from .launcher import scenario
    from .launcher.supervisor import Failure

    argv = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not argv:
        print("inmem-ft launch: give the training command after --, e.g. -- train.py --steps 100", file=sys.stderr)
        return 2
    try:
        failures = ([Failure.parse("rank", s) for s in args.kill_rank] +
                    [Failure.parse("node", s) for s in args.kill_node] + [Failure.parse("hang", s) for s in args.hang_rank])
    except ValueError as e:
        print(f"inmem-ft launch: {e}", file=sys.stderr)
        return 2
    work_dir = os.path.abspath(args.work_dir)
    os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(work_dir, "run"))
    timeline = scenario.run(args.nodes, args.ranks_per_node, args.job, args.memory_budget, argv, failures,
                            work_dir, compare=not args.no_compare, heartbeat_timeout_s=args.heartbeat_timeout,
                            max_restarts=args.max_restarts, parity=args.parity, group_size=args.group_size)
    print(timeline.format())
    print(scenario.verdict(timeline))
    scenario.write_json(timeline, os.path.join(work_dir, "timeline.json"))
    if args.plot:
        scenario.plot(timeline, args.plot, f"{args.nodes} nodes x {args.ranks_per_node} ranks")
        print(f"plot: {args.plot}")
    return 0 if timeline.ok and timeline.matches_reference is not False else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inmem-ft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    smp = sub.add_parser("smp", help="the node's snapshot management process").add_subparsers(
        dest="smp_command", required=True)
    start = smp.add_parser("start", help="start the node's SMP in the background")
    _node_args(start)
    start.add_argument("--memory-budget", type=units.parse_size, default=None,
                       help="shared memory the SMP may use for every local rank's two slots, e.g. 64GiB")
    start.add_argument("--config", default=None, metavar="JSON",
                       help="a DeepSpeed config: memory_budget, parity, group_size and spill_dir of its inmem_ft "
                            "block fill in what the command line leaves out")
    start.add_argument("--log", default=None, help="log file (default: beside the socket)")
    start.add_argument("--spill-dir", default=os.environ.get("INMEM_FT_SPILL_DIR"), metavar="DIR",
                       help="on SIGTERM (preemption) the SMP writes the newest complete step to DIR/<job>/node<N>, "
                            "and a new SMP with empty memory starts from it (default $INMEM_FT_SPILL_DIR)")
    add_ec_arguments(start)
    start.set_defaults(fn=cmd_smp_start)
    stop = smp.add_parser("stop", help="stop the node's SMP")
    _node_args(stop)
    stop.add_argument("--wipe", action="store_true", help="also delete its snapshots from memory")
    stop.set_defaults(fn=cmd_smp_stop)
    status = smp.add_parser("status", help="show the SMP's slots, steps and memory")
    _node_args(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_smp_status)

    launch = sub.add_parser("launch", help="run a job on simulated nodes on this machine, inject failures, "
                                           "recover, and print the timeline")
    launch.add_argument("--nodes", type=int, default=2)
    launch.add_argument("--ranks-per-node", type=int, default=2)
    launch.add_argument("--job", default="launch")
    launch.add_argument("--memory-budget", type=units.parse_size, default="2GiB", help="per node")
    launch.add_argument("--parity", type=int, default=None, metavar="M",
                        help="erasure-code the snapshots across nodes, surviving M lost nodes per group")
    launch.add_argument("--group-size", type=int, default=None, metavar="G", help="nodes per EC group")
    launch.add_argument("--kill-rank", action="append", default=[], metavar="STEP:RANK",
                        help="kill -9 RANK once it reaches STEP (repeatable)")
    launch.add_argument("--kill-node", action="append", default=[], metavar="STEP:NODE",
                        help="lose NODE (its ranks, its SMP and its memory) once it reaches STEP")
    launch.add_argument("--hang-rank", action="append", default=[], metavar="STEP:RANK",
                        help="freeze RANK (SIGSTOP) at STEP; the heartbeat timeout must catch it")
    launch.add_argument("--heartbeat-timeout", type=float, default=60.0, help="seconds without a heartbeat")
    launch.add_argument("--max-restarts", type=int, default=5)
    launch.add_argument("--no-compare", action="store_true", help="skip the uninterrupted reference run")
    launch.add_argument("--work-dir", default="inmem_ft_launch", help="logs, loss log, timeline.json")
    launch.add_argument("--plot", default=None, help="PNG of loss vs step with the failures marked")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, help="-- train.py [args...]")
    launch.set_defaults(fn=cmd_launch)

    surv = sub.add_parser("survival", help="probability that an in-memory snapshot is lost, EC vs replication")
    survival.add_survival_arguments(surv)
    surv.set_defaults(fn=survival.run_survival)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (InmemFTError, PermissionError) as e:
        print(f"inmem-ft: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
