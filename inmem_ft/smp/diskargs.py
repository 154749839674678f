"""The disk tier's command-line settings, shared by `inmem-ft smp start` and `python -m inmem_ft.smp`, with the
old spellings (`--spill-dir`, `--persist-every`, `$INMEM_FT_SPILL_DIR`) still taken for one release."""
from __future__ import annotations

import argparse

from .. import deprecation

PERSIST_DIR_ENV, OLD_PERSIST_DIR_ENV = "INMEM_FT_PERSIST_DIR", "INMEM_FT_SPILL_DIR"
DEFAULT_KEEP = 2


def add_disk_arguments(parser: argparse.ArgumentParser, from_env: bool, from_config: bool = False) -> None:
    """`from_env`: --persist-dir defaults to $INMEM_FT_PERSIST_DIR; `from_config`: `--config`'s block fills in
    what the command line leaves out (said in the help)."""
    g = parser.add_argument_group("disk tier (off unless --persist-dir is given)")
    env = f"${PERSIST_DIR_ENV}" if from_env else ""
    g.add_argument("--persist-dir", default=None, metavar="DIR",
                   help="the disk tier: the SMP flushes its node's slots to DIR/<job>/node<N> (every "
                        "--persist-every-steps steps, and the newest complete step on SIGTERM), and a new SMP with "
                        "empty memory starts from them (default: " + ", else ".join(
                            x for x in (env, from_config and "the config's persist_dir", "none") if x) + ")")
    g.add_argument("--persist-every-steps", type=int, default=None, metavar="STEPS",
                   help="flush each complete step that is a multiple of STEPS training steps (default: " +
                        ("the config's persist_every_steps, else " if from_config else "") + "0: only on SIGTERM)")
    g.add_argument("--persist-keep", type=int, default=None, metavar="K",
                   help="flushed steps kept per node (default: " + ("the config's persist_keep, else " if from_config
                                                                     else "") + f"{DEFAULT_KEEP})")
    # The old spellings: resolve() says what replaced them.
    g.add_argument("--spill-dir", dest="old_spill_dir", default=None, metavar="DIR",
                   help="deprecated: the old name of --persist-dir (default: none)")
    g.add_argument("--persist-every", dest="old_persist_every", type=int, default=None, metavar="STEPS",
                   help="deprecated: the old name of --persist-every-steps, the same count (default: none)")
    parser.set_defaults(disk_from_env=from_env)


def resolve(args: argparse.Namespace) -> None:
    """Old spellings into args.persist_dir / args.persist_every_steps (one deprecation line each), then the
    environment's directory where the command line gave none."""
    if args.old_spill_dir is not None:
        deprecation.deprecated("--spill-dir", "--persist-dir")
        args.persist_dir = args.persist_dir or args.old_spill_dir
    if args.old_persist_every is not None:
        deprecation.deprecated("--persist-every", "--persist-every-steps", "the same count of training steps")
        if args.persist_every_steps is None:
            args.persist_every_steps = args.old_persist_every
    if args.persist_dir is None and args.disk_from_env:
        args.persist_dir = deprecation.env(PERSIST_DIR_ENV, OLD_PERSIST_DIR_ENV)
