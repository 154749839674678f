"""`inmem-ft survival`: how likely is an in-memory snapshot to be lost before the next one is protected?

Model: node failures are independent, exponential with rate 1/MTBF. A snapshot must survive a window
of one snapshot interval plus the time to protect its successor (re-protect time); a node fails in
that window with probability p = 1 - exp(-window / MTBF). Failed nodes are assumed not to be rebuilt
within the window, which overstates the risk when rebuilds are fast.

Schemes compared at the same memory budget:
- EC: N/G groups of G nodes, each tolerating any m losses (parity memory m/(G-m) per node); a group
  loses the snapshot when more than m of its nodes fail.
- replication: r = floor(m/(G-m)) extra full copies, in groups of r+1 nodes that each hold copies of
  one another's data (nvidia-resiliency-ext's clique replication); a group loses the snapshot when all
  its nodes fail.
- none: any failed node loses the snapshot.
The job loses the snapshot if any group does.
"""

import math
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Inputs:
    nodes: int
    group_size: int
    parity: int
    mtbf_hours: float
    interval_s: float
    reprotect_s: float = 0.0

    @property
    def window_s(self):
        return self.interval_s + self.reprotect_s


@dataclass(frozen=True)
class Risk:
    scheme: str
    tolerates: str
    memory_overhead: float  # extra memory per node, as a fraction of its own snapshot
    p_loss: float
    note: str = ""


def validate(inp):
    """Raises ValueError saying what is wrong and what to choose instead."""
    for name in ("nodes", "group_size", "parity"):
        value = getattr(inp, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if inp.group_size < 2:
        raise ValueError(
            f"group size G must be >= 2 (a group protects its nodes against each other), got {inp.group_size}"
        )
    if inp.parity >= inp.group_size:
        raise ValueError(
            f"parity m must be smaller than the group size G (m={inp.parity}, G={inp.group_size}): "
            f"a group of G nodes keeps G-m data chunks per stripe"
        )
    if inp.nodes % inp.group_size:
        rest = inp.nodes % inp.group_size
        lower, upper = inp.nodes - rest, inp.nodes - rest + inp.group_size
        raise ValueError(
            f"N={inp.nodes} nodes do not split into groups of G={inp.group_size}: {rest} node(s) would be "
            f"left without an EC group; use N a multiple of G (e.g. {lower or upper} or {upper}) or another G"
        )
    if not inp.mtbf_hours > 0:
        raise ValueError(f"node MTBF must be > 0 hours, got {inp.mtbf_hours}")
    if not inp.interval_s > 0:
        raise ValueError(f"snapshot interval must be > 0 seconds, got {inp.interval_s}")
    if not inp.reprotect_s >= 0:
        raise ValueError(f"re-protect time must be >= 0 seconds, got {inp.reprotect_s}")


def node_failure_probability(window_s, mtbf_hours):
    return -math.expm1(-window_s / (mtbf_hours * 3600.0))


def more_than_m_fail(G, m, p):
    """P(more than m of G independent nodes fail), each with probability p."""
    q = 1.0 - p
    # Summed from the tail rather than 1 - CDF, which would round tiny probabilities to zero.
    return min(1.0, sum(math.comb(G, i) * p**i * q ** (G - i) for i in range(m + 1, G + 1)))


def any_of(groups, p_group):
    """P(at least one of `groups` independent groups is lost), accurate for tiny p_group."""
    if p_group >= 1.0:
        return 1.0
    return -math.expm1(groups * math.log1p(-p_group))


def ec_risk(inp, p):
    G, m = inp.group_size, inp.parity
    k = G - m
    groups = inp.nodes // G
    return Risk(
        scheme=f"EC RS(k={k},m={m}), {groups} group(s) of {G}",
        tolerates=f"any {m} per group",
        memory_overhead=m / k,
        p_loss=any_of(groups, more_than_m_fail(G, m, p)),
    )


def replication_risk(inp, p):
    """Full copies within the EC setting's extra memory; where that holds not even one copy, the cheapest
    replication (one copy) is still costed, with its memory marked over the budget."""
    k = inp.group_size - inp.parity
    budget = inp.parity / k
    r = max(1, inp.parity // k)
    size = r + 1
    groups, rest = divmod(inp.nodes, size)
    notes = []
    if r > budget:
        notes.append(f"one full copy needs {r:.0%} extra memory, more than the {budget:.0%} EC uses here: "
                     f"shown at its own cost")
    if rest:
        # Folding the leftover nodes into the last group gives them more copies than the budget, which
        # flatters replication: the comparison stays fair to the baseline.
        notes.append(f"the {rest} leftover node(s) join the last group of {size} (more copies than the budget)")
        p_loss = 1.0 - (1.0 - any_of(groups - 1, p**size)) * (1.0 - p ** (size + rest))
    else:
        p_loss = any_of(groups, p**size)
    return Risk(
        scheme=f"replication x{r}, {groups} group(s) of {size}",
        tolerates=f"any {r} per group",
        memory_overhead=float(r),
        p_loss=p_loss,
        note="; ".join(notes),
    )


def no_protection_risk(inp, p):
    return Risk(scheme="no protection", tolerates="none", memory_overhead=0.0, p_loss=any_of(inp.nodes, p))


def survival(inp):
    """[Risk] for EC, replication at the same memory budget, and no protection."""
    validate(inp)
    p = node_failure_probability(inp.window_s, inp.mtbf_hours)
    return [ec_risk(inp, p), replication_risk(inp, p), no_protection_risk(inp, p)]


def _duration(seconds):
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def format_report(inp, risks):
    p = node_failure_probability(inp.window_s, inp.mtbf_hours)
    header = ("scheme", "tolerates", "extra memory", "P(snapshot lost)", "about one loss every")
    rows = []
    for risk in risks:
        if risk.p_loss == 0.0:
            chance, every = "< 1e-308", "never (below float precision)"
        else:
            chance, every = f"{risk.p_loss:.3e}", _duration(inp.interval_s / risk.p_loss)
        rows.append((risk.scheme, risk.tolerates, f"{risk.memory_overhead:.0%}", chance, every))
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [
        f"{inp.nodes} nodes, MTBF {inp.mtbf_hours:g} h each; window {inp.window_s:g} s "
        f"(snapshot interval {inp.interval_s:g} s + re-protect {inp.reprotect_s:g} s)",
        f"P(a given node fails within the window) = {p:.3e}",
        "",
    ]
    for row in [header] + rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    notes = [f"{risk.scheme}: {risk.note}" for risk in risks if risk.note]
    if notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def add_survival_arguments(parser):
    parser.add_argument("-N", "--nodes", type=int, required=True, help="nodes in the job (required)")
    parser.add_argument("-G", "--group-size", type=int, required=True,
                        help="nodes per EC group, G = k + m (k data, m parity); must divide N (required)")
    parser.add_argument("-m", "--parity", type=int, required=True, help="parity m: node losses each group tolerates (required)")
    parser.add_argument("--mtbf-hours", type=float, required=True, help="mean time between failures of one node (required)")
    parser.add_argument("--interval-s", type=float, required=True, help="seconds between snapshots (required)")
    parser.add_argument(
        "--reprotect-s",
        type=float,
        default=0.0,
        help="seconds to encode and spread a new snapshot's parity (default: 0)",
    )
    return parser


def run_survival(args):
    inp = Inputs(args.nodes, args.group_size, args.parity, args.mtbf_hours, args.interval_s, args.reprotect_s)
    try:
        risks = survival(inp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(format_report(inp, risks))
    return 0
