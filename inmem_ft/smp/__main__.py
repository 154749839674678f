"""python -m inmem_ft.smp: run one node's SMP in the foreground (`inmem-ft smp start` daemonizes this)."""
import logging
import os
import sys

from .. import units
from ..argtypes import Parser, job_id, node_id
from ..cluster.flushnow import FlushNow
from ..cluster.options import add_ec_arguments, make_peers, make_protector, options_from_args
from ..cluster.slotreads import SlotReads
from ..errors import InmemFTError
from ..telemetry import log_to_stderr
from . import paths
from .daemon import SMP, check_budget_fits
from .diskargs import DEFAULT_KEEP, add_disk_arguments, resolve as resolve_disk
from .disktier import DiskTier
from .metrics import Exporter, add_metrics_arguments
from .nodelock import NodeLock


def main(argv=None) -> int:
    p = Parser(prog="python -m inmem_ft.smp")
    p.add_argument("--job", type=job_id, default=os.environ.get("INMEM_FT_JOB", "default"),
                   help="job id (default: $INMEM_FT_JOB, else 'default')")
    p.add_argument("--node", type=node_id, default=os.environ.get("INMEM_FT_NODE", "0"),
                   help="this node's index (default: $INMEM_FT_NODE, else 0)")
    p.add_argument("--socket", default=None, help="control socket path (default: <runtime dir>/<job>/node<node>.sock)")
    p.add_argument("--memory-budget", required=True, type=units.argparse_size,
                   help="shared memory for every local rank's two slots, e.g. 64GiB (required)")
    add_disk_arguments(p, from_env=False)
    add_ec_arguments(p)
    add_metrics_arguments(p)
    args = p.parse_args(argv)
    log_to_stderr()
    resolve_disk(args)
    smp = None
    try:
        ec = options_from_args(args)
        check_budget_fits(args.memory_budget, args.job, args.node)
        smp = SMP(args.job, args.node, args.socket or paths.default_socket(args.job, args.node), args.memory_budget)
        smp.node_lock = NodeLock.acquire(args.job, args.node)
        smp.adopt_existing()
        smp.peers = make_peers(args, args.node, args.job)
        if args.persist_dir:
            smp.disk = DiskTier(smp, args.persist_dir, args.persist_every_steps or 0,
                                DEFAULT_KEEP if args.persist_keep is None else args.persist_keep)
            smp.disk.adopt()
        if ec is not None:
            smp.protector = make_protector(smp, ec, smp.peers)
            smp.protector.adopt()
        smp.reads = SlotReads(smp, smp.peers, smp.protector)
        smp.flushes = FlushNow(smp, smp.peers)
        if args.metrics_port or args.metrics_textfile:
            smp.metrics = Exporter(smp.status, args.metrics_port, args.metrics_addr, args.metrics_textfile)
    except (InmemFTError, OSError, ValueError) as e:
        # One line in the log, which `inmem-ft smp start` shows: setup errors are the user's to fix.
        logging.getLogger("inmem_ft.smp").error("smp node=%d event=failed reason=%s", args.node, e)
        if smp is not None and smp.node_lock is not None:
            smp.node_lock.release()
        return 1
    smp.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
