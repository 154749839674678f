"""python -m inmem_ft.smp: run one node's SMP in the foreground (`inmem-ft smp start` daemonizes this)."""
import argparse
import logging
import os
import sys

from .. import units
from ..cluster.options import add_ec_arguments, make_protector, options_from_args
from . import paths, spill
from .daemon import SMP, check_budget_fits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m inmem_ft.smp")
    p.add_argument("--job", default=os.environ.get("INMEM_FT_JOB", "default"))
    p.add_argument("--node", type=int, default=int(os.environ.get("INMEM_FT_NODE", "0")))
    p.add_argument("--socket", default=None)
    p.add_argument("--memory-budget", required=True, type=units.parse_size)
    p.add_argument("--spill-dir", default=None,
                   help="on SIGTERM write the newest complete step to DIR/<job>/node<N>; start from it when "
                        "shared memory holds nothing")
    add_ec_arguments(p)
    args = p.parse_args(argv)
    ec = options_from_args(args)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [inmem_ft] %(message)s")
    check_budget_fits(args.memory_budget)
    smp = SMP(args.job, args.node, args.socket or paths.default_socket(args.job, args.node), args.memory_budget)
    smp.adopt_existing()
    if args.spill_dir:
        smp.spill_dir = spill.node_dir(args.spill_dir, args.job, args.node)
        spill.adopt(smp, smp.spill_dir)
    if ec is not None:
        smp.protector = make_protector(smp, ec)
        smp.protector.adopt()
    smp.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
