"""Peer and erasure-coding settings of an SMP: its command-line arguments, and the argv that starts one.

`inmem-ft smp start` and `python -m inmem_ft.smp` share `add_ec_arguments`; launchers build an
`ECOptions` (or pass --peers alone, for cross-node reads without parity) through `smp.control.start`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import units
from ..errors import ConfigError
from .groups import Groups
from .transport import MAX_PAYLOAD, load_secret, parse_peers


@dataclass(frozen=True)
class ECOptions:
    parity: int  # m: lost nodes per group the job survives
    nodes: int
    peers: str  # NODE=HOST:PORT,... for every node (at least every member of this node's group)
    group_size: int | None = None  # default: groups.default_group_size
    secret_file: str | None = None  # None: the secret itself is in $INMEM_FT_SECRET
    bandwidth: int | None = None  # bytes/s of outgoing parity traffic; None: uncapped
    peer_wait_s: float = 0.0  # an empty SMP waits this long for peers not yet listening (see Protector)
    rebuild_piece: int | None = None  # bytes per pull when rebuilding a lost node; None: rebuild.PIECE
    max_peer_read: int | None = None  # largest range one peer read may ask; None: transport.MAX_PAYLOAD

    def groups(self) -> Groups:
        if self.group_size is None:
            return Groups.default(self.nodes, self.parity)
        return Groups.consecutive(self.nodes, self.group_size, self.parity)

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
        if self.rebuild_piece:
            out += ["--rebuild-piece", str(self.rebuild_piece)]
        if self.max_peer_read:
            out += ["--max-peer-read", str(self.max_peer_read)]
        return out


def add_ec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("erasure coding across nodes (off unless --parity is given)")
    g.add_argument("--parity", type=int, default=None, metavar="M",
                   help="lost nodes per EC group to survive; 0 turns erasure coding off (default: off, or "
                        "the parity of `smp start --config`)")
    g.add_argument("--rebuild-piece", type=units.argparse_size, default=None, metavar="BYTES",
                   help="bytes a replacement node pulls per stripe and survivor at a time while it rebuilds: its "
                        "memory beyond its own segments is (group size) x this; a multiple of 64 (default: 8MiB)")
    g.add_argument("--max-peer-read", type=units.argparse_size, default=None, metavar="BYTES",
                   help="largest byte range this SMP serves to one parity or rebuild read of a peer; lowering it "
                        "shows that rebuilds of any node size stay in pieces (default: 4GiB, one peer message)")
    g.add_argument("--nodes", type=int, default=None, metavar="N", help="number of nodes in the job (default: none)")
    g.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="nodes per EC group, G = k + m (k data, m = --parity), consecutive node ids (default: "
                        "largest divisor of --nodes <= 8)")
    p = parser.add_argument_group("SMP-to-SMP links: cross-node reads, and erasure coding when --parity is given")
    p.add_argument("--peers", default=None, metavar="NODE=HOST:PORT,...",
                   help="SMP-to-SMP address of every node (default: none: this node's snapshots only)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="file holding the per-job secret (at least 16 bytes), mode 0600 (default: none: the secret "
                        "itself is then read from $INMEM_FT_SECRET)")
    p.add_argument("--ec-bandwidth", type=units.argparse_size, default=None, metavar="BYTES_PER_S",
                   help="cap on outgoing SMP-to-SMP bulk traffic, bytes per second (default: uncapped)")
    p.add_argument("--peer-wait", type=float, default=0.0, metavar="SECONDS",
                   help="an SMP starting with empty memory waits this long for peers that do not answer yet "
                        "before it concludes there is nothing to rebuild, for SMPs started together (default: 0)")


def options_from_args(args: argparse.Namespace, asked_by: str = "--parity") -> ECOptions | None:
    """The EC settings of a node's SMP, checked here (before any daemon starts) so that a bad peer list,
    group or secret is one line at the command, not a traceback in the daemon's log. `asked_by` names
    where the parity came from, for the message when --nodes/--peers are missing. Peers given without parity
    are checked all the same (check_peers): they serve cross-node reads."""
    if not args.parity:
        check_peers(args)
        return None
    if args.nodes is None or not args.peers:
        raise ConfigError(f"{asked_by} asks for erasure coding across nodes: add --nodes N and --peers "
                          f"0=HOST:PORT,1=HOST:PORT,... (every node's SMP address), or --parity 0 for a "
                          f"single node without it")
    options = ECOptions(args.parity, args.nodes, args.peers, args.group_size, args.secret_file, args.ec_bandwidth,
                        args.peer_wait, args.rebuild_piece, args.max_peer_read)
    from .protection import PIECE as PULL_PIECE  # here: the CLI imports this module, not numpy

    most = args.max_peer_read or MAX_PAYLOAD
    if not PULL_PIECE <= most <= MAX_PAYLOAD:
        raise ConfigError(f"--max-peer-read {most}: give {PULL_PIECE} (what protection pulls at a time) to "
                          f"{MAX_PAYLOAD} (one peer message) bytes")
    if args.rebuild_piece is not None and not (0 < args.rebuild_piece <= most and args.rebuild_piece % 64 == 0):
        raise ConfigError(f"--rebuild-piece {args.rebuild_piece}: give a multiple of 64 bytes up to {most} "
                          f"(--max-peer-read), e.g. 8MiB")
    try:
        groups = options.groups()
    except ValueError as e:
        raise ConfigError(f"--parity {args.parity} --nodes {args.nodes}: {e}") from None
    if not 0 <= args.node < args.nodes:
        raise ConfigError(f"--node {args.node} is outside the job's --nodes {args.nodes} (0..{args.nodes - 1})")
    missing = sorted(set(groups.members(args.node)) - set(check_peers(args)))
    if missing:
        raise ConfigError(f"--peers lacks the address of node(s) {missing} of node {args.node}'s EC group")
    return options


def check_peers(args: argparse.Namespace) -> dict[int, tuple[str, int]]:
    """The peer list, checked as the daemon's Peers would take it (parsed, this node listed, the secret readable),
    so a bad one is one line at the command; {} without --peers."""
    if not args.peers:
        return {}
    try:
        peers = parse_peers(args.peers)
    except ValueError as e:
        raise ConfigError(f"--peers: {e}") from None
    if args.node not in peers:
        raise ConfigError(f"--node {args.node} is not in --peers (nodes {sorted(peers)}): give this node's id, or "
                          f"add its NODE=HOST:PORT to --peers")
    try:
        load_secret(args.secret_file)
    except OSError as e:
        raise ConfigError(f"--secret-file: {e.strerror}: {e.filename}") from None
    return peers


def peer_argv(args: argparse.Namespace) -> list[str]:
    """The daemon arguments of SMP-to-SMP links without erasure coding (ECOptions.argv carries them with it)."""
    if not args.peers:
        return []
    out = ["--peers", args.peers]
    if args.secret_file:
        out += ["--secret-file", args.secret_file]
    if args.ec_bandwidth:
        out += ["--ec-bandwidth", str(args.ec_bandwidth)]
    return out


def make_peers(args: argparse.Namespace, node: int, job: str):
    """The SMP's peer links: networked with --peers (the job secret is then required), else local only."""
    from .peers import Peers

    if not args.peers:
        return Peers(node, job, {})
    return Peers(node, job, parse_peers(args.peers), load_secret(args.secret_file), args.ec_bandwidth)


def make_protector(smp, options: ECOptions, peers):
    from . import rebuild
    from .protection import Protector

    return Protector(smp, options.groups(), peers, options.peer_wait_s, options.rebuild_piece or rebuild.PIECE,
                     options.max_peer_read or MAX_PAYLOAD)
