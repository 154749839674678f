"""Erasure-coding settings of an SMP: its command-line arguments, and the argv that starts one with them.

`inmem-ft smp start` and `python -m inmem_ft.smp` share `add_ec_arguments`; launchers build an
`ECOptions` and pass `argv()` through `smp.control.start`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import units
from .groups import Groups
from .transport import load_secret, parse_peers


@dataclass(frozen=True)
class ECOptions:
    parity: int  # m: lost nodes per group the job survives
    nodes: int
    peers: str  # NODE=HOST:PORT,... for every node (at least every member of this node's group)
    group_size: int | None = None  # default: groups.default_group_size
    secret_file: str | None = None  # default: INMEM_FT_SECRET
    bandwidth: int | None = None  # bytes/s of outgoing parity traffic; None: uncapped
    peer_wait_s: float = 0.0  # an empty SMP waits this long for peers not yet listening (see Protector)

    def groups(self) -> Groups:
        if self.group_size is None:
            return Groups.default(self.nodes, self.parity)
        return Groups(self.nodes, self.group_size, self.parity)

    def argv(self) -> list[str]:
        out = ["--parity", str(self.parity), "--nodes", str(self.nodes), "--peers", self.peers]
        if self.group_size is not None:
            out += ["--group-size", str(self.group_size)]
        if self.secret_file:
            out += ["--secret-file", self.secret_file]
        if self.bandwidth:
            out += ["--ec-bandwidth", str(self.bandwidth)]
        if self.peer_wait_s:
            out += ["--peer-wait", str(self.peer_wait_s)]
        return out


def add_ec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("erasure coding across nodes (off unless --parity is given)")
    g.add_argument("--parity", type=int, default=None, metavar="M", help="lost nodes per EC group to survive")
    g.add_argument("--nodes", type=int, default=None, help="number of nodes in the job")
    g.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="nodes per EC group (consecutive node ids); default: largest divisor of --nodes <= 8")
    g.add_argument("--peers", default=None, help="NODE=HOST:PORT,... SMP-to-SMP address of every node")
    g.add_argument("--secret-file", default=None, help="per-job secret (mode 0600); default $INMEM_FT_SECRET")
    g.add_argument("--ec-bandwidth", type=units.parse_size, default=None, metavar="BYTES_PER_S",
                   help="cap on outgoing parity traffic, bytes per second")
    g.add_argument("--peer-wait", type=float, default=0.0, metavar="SECONDS",
                   help="an SMP starting with empty memory waits this long for peers that do not answer yet "
                        "before it concludes there is nothing to rebuild (for SMPs started together)")


def options_from_args(args: argparse.Namespace) -> ECOptions | None:
    if args.parity is None:
        return None
    if args.nodes is None or not args.peers:
        raise SystemExit("erasure coding (--parity) needs --nodes and --peers NODE=HOST:PORT,...")
    return ECOptions(args.parity, args.nodes, args.peers, args.group_size, args.secret_file, args.ec_bandwidth,
                     args.peer_wait)


def make_protector(smp, options: ECOptions):
    from .protection import Protector

    return Protector(smp, options.groups(), parse_peers(options.peers), load_secret(options.secret_file),
                     options.bandwidth, options.peer_wait_s)
