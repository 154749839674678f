"""`inmem-ft run`: torchrun with inmem_ft's agent. Every torchrun option and the rendezvous (c10d, static) are
torch's own (its parser, config_from_args, launch_agent); the agent launch_agent builds is ours (agent.py).

    inmem-ft run --nproc-per-node 8 --nnodes 2 --rdzv-endpoint node0:29500 --memory-budget 64GiB train.py ...
"""
from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys

from .. import argtypes
from ..errors import InmemFTError
from ..smp import paths
from . import lines

WORKER = "inmem_ft.agent.worker"


_seconds = argtypes.bounded(float, "{text!r} is not a number of seconds >= 0", minimum=0)
_count = argtypes.bounded(int, "{text!r} is not a whole number >= 0", minimum=0)
# torch's rendezvous reads its last-call wait as whole seconds (RendezvousParameters.get_as_int)
_whole_seconds = argtypes.bounded(int, "{text!r} is not a whole number of seconds >= 0", minimum=0)
SPARE_WAIT_S = 5


def _poll(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0.01:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number of seconds >= 0.01")
    return value


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "inmem-ft run"
    p.description = "torchrun with inmem_ft's agent: the node's SMP, hang detection, the time lost per failure"
    g = p.add_argument_group("inmem_ft")
    env = os.environ.get
    g.add_argument("--job", default=env("INMEM_FT_JOB"),
                   help="job id, 1-64 of [A-Za-z0-9_-], the same on every node (default: $INMEM_FT_JOB, else "
                        "--rdzv-id)")
    g.add_argument("--memory-budget", default=env("INMEM_FT_MEMORY_BUDGET"), metavar="SIZE",
                   help="shared memory this node's SMP may use, e.g. 64GiB; needed unless an SMP of this job "
                        "and node already runs (default: $INMEM_FT_MEMORY_BUDGET)")
    g.add_argument("--smp-args", default=env("INMEM_FT_SMP_ARGS", ""), metavar="ARGS",
                   help="more `inmem-ft smp start` arguments, e.g. \"--parity 1 --nodes 4 --peers ...\" "
                        "(default: $INMEM_FT_SMP_ARGS)")
    g.add_argument("--hang-timeout", type=_seconds, default=env("INMEM_FT_HANG_TIMEOUT", "300"), metavar="S",
                   help="a rank whose heartbeat (one per step) is older than S seconds is hung: its stacks go to "
                        "its log and the agent's, it is killed and the ranks restart; 0: off (default: 300, "
                        "or $INMEM_FT_HANG_TIMEOUT)")
    g.add_argument("--dump-wait", type=_seconds, default=1.0, metavar="S",
                   help="seconds a hung rank has to print its stacks before it is killed (default: 1)")
    g.add_argument("--standbys", type=_count, default=env("INMEM_FT_STANDBYS"), metavar="N",
                   help="warm standby processes: each has imported torch and what the ranks import (a few hundred "
                        "MiB of host memory each, no GPU memory) and waits to become a restarted rank, which then "
                        "skips its imports; 0: off, every restart cold (default: one per local rank, or "
                        "$INMEM_FT_STANDBYS)")
    g.add_argument("--rdzv-poll", type=_poll, default=env("INMEM_FT_RDZV_POLL", "auto"), metavar="S",
                   help="how often the c10d rendezvous re-reads its store while it waits for the other nodes, in "
                        "seconds; auto: the number of nodes x 1 ms, at least 0.05 and at most 1 (torch's fixed "
                        "poll), so that the store is read at most about 1000 times a second (default: auto, or "
                        "$INMEM_FT_RDZV_POLL)")
    g.add_argument("--spare-wait", type=_whole_seconds, default=env("INMEM_FT_SPARE_WAIT", str(SPARE_WAIT_S)),
                   metavar="S",
                   help="with --nnodes MIN:MAX, how long the nodes left after a node loss wait for a node to take "
                        "its place before they go on without it (fewer nodes, the state resharded from memory): "
                        "torch's last-call wait from the second rendezvous round on (the first, at the start, "
                        "keeps torch's, 30 s or --rdzv-conf last_call_timeout, for every node to come up); with "
                        f"--nnodes N or N:N nothing changes (default: {SPARE_WAIT_S}, or $INMEM_FT_SPARE_WAIT)")
    g.add_argument("--work-dir", default=None, metavar="DIR",
                   help="heartbeats, rank records and time_lost.json (default: <runtime dir>/<job>/agent-node<N>)")
    g.add_argument("--wipe-on-exit", default=env("INMEM_FT_WIPE_ON_EXIT", "finished"), choices=WIPE_RULES,
                   help="when this node's snapshots leave shared memory as the run ends: finished (the ranks "
                        "succeeded), 1 (always), 0 (never) (default: finished, or $INMEM_FT_WIPE_ON_EXIT)")
    return p


WIPE_RULES = ("finished", "1", "0")
STATIC_RESTARTS = ("torchrun's static rendezvous (its default without --standalone or --rdzv-backend) keeps one store "
                   "for every restart, where the restarted ranks find the dead ranks' addresses (Gloo connectFullMesh "
                   "... Connection refused): on one node use --standalone, else --rdzv-backend c10d --rdzv-endpoint "
                   "HOST:PORT (or --max-restarts 0)")


def options(args):
    from torch.distributed.run import parse_min_max_nnodes

    from .agent import AgentOptions

    if args.rdzv_backend == "static" and not args.standalone and args.max_restarts > 0:
        raise InmemFTError(STATIC_RESTARTS)
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        raise InmemFTError(f"--nnodes {args.nnodes!r} must be N or MIN:MAX (whole numbers, MIN <= MAX)") from None
    if not 1 <= min_nodes <= max_nodes:
        raise InmemFTError(f"--nnodes {args.nnodes!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
    if min_nodes < max_nodes and args.rdzv_backend == "static":
        raise InmemFTError(f"--nnodes {args.nnodes}: a node range needs the c10d rendezvous (--rdzv-backend c10d "
                           f"--rdzv-endpoint HOST:PORT); torchrun's static rendezvous has a fixed node count")
    if args.wipe_on_exit not in WIPE_RULES:  # argparse checks a given value only, not $INMEM_FT_WIPE_ON_EXIT
        raise InmemFTError(f"--wipe-on-exit / INMEM_FT_WIPE_ON_EXIT {args.wipe_on_exit!r} must be finished, 1 or 0")
    job = args.job or (args.rdzv_id if args.rdzv_id != "none" else None)
    if not job:
        raise InmemFTError("give the job an id: --job (or INMEM_FT_JOB, or --rdzv-id), the same on every node")
    try:
        paths.check_job(job)
    except ValueError as e:
        raise InmemFTError(str(e)) from None
    node = os.environ.get("INMEM_FT_NODE", str(args.node_rank))  # the SMP's node id; the launch script's own
    if not node.isdigit():
        raise InmemFTError(f"INMEM_FT_NODE / --node-rank {node!r} must be a non-negative integer")
    node = int(node)
    # The agent exports the socket to its SMP and ranks once it runs (agent.run); reading options changes nothing.
    socket = os.environ.get("INMEM_FT_SMP_SOCKET") or paths.default_socket(job, node)
    work_dir = args.work_dir or os.path.join(paths.job_dir(job), f"agent-node{node}")
    return AgentOptions(job=job, node=node, socket=socket,
                        memory_budget=args.memory_budget, smp_args=shlex.split(args.smp_args),
                        hang_timeout_s=args.hang_timeout, dump_wait_s=args.dump_wait,
                        work_dir=os.path.abspath(work_dir), wipe_on_exit=args.wipe_on_exit, standbys=args.standbys,
                        rdzv_poll_s=args.rdzv_poll, nodes=(min_nodes, max_nodes), spare_wait_s=args.spare_wait)


def through_worker(args) -> None:
    """Run the training command through agent/worker.py, which records when the rank's rendezvous began and
    ended (the time-lost split). A --no-python or --run-path command runs as given."""
    if args.no_python or args.run_path:
        return
    command = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = ["--", *command, *args.training_script_args]
    args.training_script, args.module = WORKER, True


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .agent import InmemAgent

    args = parser().parse_args(argv)
    try:
        opts = options(args)
    except InmemFTError as e:
        return lines.refuse(os.environ.get("INMEM_FT_NODE", args.node_rank), 2, str(e))
    try:
        # The SMP refuses a socket directory others can read: made owner-only before torch makes the log
        # directory inside it (os.makedirs would give it the umask's mode, 0755 under the usual 022).
        paths.make_private_dir(os.path.dirname(opts.socket))
    except OSError as e:
        return lines.refuse(opts.node, 2, str(e))
    through_worker(args)
    if not (args.redirects != "0" or args.tee != "0"):
        args.tee = "3"  # rank logs in files (their restore lines and stacks) and on the console, as before
    args.log_dir = args.log_dir or os.path.join(opts.work_dir, "logs")
    # By default the ranks of every attempt share the rendezvous store, where the previous attempt's gloo/NCCL
    # addresses are still found: a restarted rank connects to a dead port ("Connection refused") and the
    # restarts are used up. A fresh store per round avoids that (as launch_scripts/torchrun_inmem.sh does).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # launch_agent builds its agent by this name, and offers no other way in: copying it would copy ~100 lines
    # of torch that change between releases (DLRover and nvidia-resiliency-ext do).
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = functools.partial(InmemAgent, options=opts)
    try:
        torchrun.run(args)
        rc = 0
    except ChildFailedError as e:
        print(f"inmem-ft run: error: {e.format_msg()}", file=sys.stderr)  # torchrun's report of the failures
        rc = 1
    except InmemFTError as e:
        return lines.refuse(opts.node, 3, str(e))
    except SignalException as e:  # the ranks and the SMP are stopped already
        rc = 128 + int(e.sigval)
    finally:
        launcher_api.LocalElasticAgent = original
    lines.say("launch", opts.node, "torchrun_exit", rc=rc)
    return rc
