"""A seeded discrete-event simulation of a long training run under failures: effective training time and where
the rest of the time went.

The run alternates training segments and recoveries. In a segment, training computes for `interval_s`, then
blocks `blocking_s` for a snapshot, again and again; a snapshot is usable after a crash once committed
(`commit_s` after its blocking ends), survives a lost node once protected (`protect_s` after), and every
`persist_every`-th is on disk `persist_s` after. A failure ends the segment; the restore point is the newest
snapshot the failure left usable:

- crash or hang (the node's memory stays): the newest committed snapshot; a hang first stalls the job for the
  detection timeout;
- lost nodes, at most m in each EC group (counting nodes of the group still being rebuilt and re-protected):
  the newest protected snapshot; a loss during a snapshot's protection falls back to the one before it;
- more than m in a group: the newest snapshot on disk (or the start of the run).

A lost node also costs what the strategy does about the node (`node_loss`): waiting for a spare to arrive, or
shrinking onto the survivors (the shrink's extra work, training on fewer nodes until the spare arrives, then
the grow's restart).

A disk-checkpoint strategy (`in_memory=False`) restores every failure from disk. The recovery costs the
detection, the restart, and the restore from the tier that serves it; the work since the restore point is
computed again. Failures strike while the job trains; failures during a recovery are not modelled (recoveries
are about 1% of the time in the cases this plans). Failures arrive as a Poisson process over the nodes, or
from a fixed schedule (`Schedule`) to replay a measured run.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field

from .inputs import FailureModel

ACCOUNTS = ("useful", "snapshot blocking", "recompute", "hang detection", "detection", "restart",
            "restore (memory)", "restore (peers)", "restore (disk)", "spare wait", "shrink", "shrunk (fewer nodes)",
            "grow")


@dataclass(frozen=True)
class Strategy:
    name: str
    interval_s: float  # compute between snapshots
    blocking_s: float  # training paused per snapshot
    commit_s: float  # from the end of blocking until a crash can restore it
    protect_s: float  # from the end of blocking until a lost node can be rebuilt from it
    persist_every: int  # every K-th snapshot reaches disk (0: none)
    persist_s: float  # from the end of blocking until that one is on disk
    restore_memory_s: float
    restore_peers_s: float  # rebuild a lost node from its group, then restore
    restore_disk_s: float
    group_size: int = 1  # G nodes per group
    tolerate: int = 0  # m: lost nodes per group survived
    in_memory: bool = True  # False: disk checkpoints only
    groups_span_racks: bool = True  # members of a group in distinct failure domains (racks)
    node_loss: tuple[tuple[str, float], ...] = ()  # (account, seconds) added to every loss of nodes


@dataclass(frozen=True)
class Restart:
    detect_s: float
    restart_s: float
    hang_timeout_s: float


@dataclass(frozen=True)
class Schedule:
    """Fixed failures instead of random ones, in order: (compute seconds reached, kind, nodes lost, seconds its
    detection + restart + restore take or None for the strategy's), e.g. a measured run's failures and parts."""

    failures: tuple[tuple[float, str, int, float | None], ...]


@dataclass
class Run:
    wall_s: float
    accounts: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    restores: Counter = field(default_factory=Counter)
    lost_per_failure: list[float] = field(default_factory=list)  # seconds: computed again + the recovery
    recomputed: list[float] = field(default_factory=list)  # compute seconds lost, per failure

    @property
    def effective(self) -> float:
        return self.accounts["useful"] / self.wall_s


class _Job:
    """The state between failures: work retained, what each tier holds, which groups are still degraded."""

    def __init__(self, s: Strategy, nodes: int):
        self.s, self.nodes = s, nodes
        self.groups = max(1, nodes // s.group_size)
        self.work = 0.0  # compute seconds retained (snapshots are taken every interval_s of it)
        self.base_protected_at = 0.0  # when the snapshot the segment started from is protected again
        self.protected_before = 0.0  # the newest protected snapshot before that (a loss during re-protection)
        self.disk = 0.0  # work of the newest snapshot on disk
        self.degraded: dict[int, list[float]] = {}  # group -> until when each of its lost nodes is not rebuilt

    def group_of(self, node: int) -> int:
        # Spanning racks: consecutive nodes (a rack) go to different groups; otherwise a group is G consecutive.
        return node % self.groups if self.s.groups_span_racks else node // self.s.group_size

    def segment(self, start: float, until: float) -> tuple[float, float, dict[str, float]]:
        """(compute, blocking, newest usable work per tier) for a segment from `start` cut at `until`."""
        s, e = self.s, until - start
        cycle = s.interval_s + s.blocking_s
        n = int(e // cycle)
        rest = e - n * cycle
        compute = n * s.interval_s + min(rest, s.interval_s)
        blocking = n * s.blocking_s + max(0.0, rest - s.interval_s)

        def newest(lag: float) -> int:  # snapshots of this segment done `lag` after their blocking ended
            return max(0, int(math.floor((e - lag) / cycle))) if e >= lag else 0

        committed = self.work + newest(s.commit_s) * s.interval_s
        j = newest(s.protect_s)
        if j:
            protected = self.work + j * s.interval_s
        else:
            protected = self.work if until >= self.base_protected_at else self.protected_before
        disk = self.disk
        if s.persist_every:
            j = newest(s.persist_s)
            j -= (round(self.work / s.interval_s) + j) % s.persist_every
            if j >= 1:
                disk = max(disk, self.work + j * s.interval_s)
        return compute, blocking, {"memory": committed, "peers": protected, "disk": disk}

    def lose(self, nodes: list[int], t: float) -> bool:
        """Whether every group keeps at most m lost nodes; records the new losses as degraded from `t`."""
        ok = True
        for node in nodes:
            g = self.group_of(node)
            down = [u for u in self.degraded.get(g, []) if u > t]
            if len(down) + 1 > self.s.tolerate:
                ok = False
            self.degraded[g] = down + [math.inf]  # until the recovery says when it is re-protected
        return ok

    def recovered(self, t_resume: float) -> None:
        for g, until in self.degraded.items():
            self.degraded[g] = [t_resume + self.s.protect_s if u == math.inf else u for u in until]


def simulate(s: Strategy, restart: Restart, nodes: int, wall_s: float, failures: FailureModel | Schedule,
             seed: int = 0) -> Run:
    rng = random.Random(seed)
    run, job, t = Run(wall_s), _Job(s, nodes), 0.0
    kinds = failures.kinds() if isinstance(failures, FailureModel) else None
    rate = nodes * failures.per_node_per_hour / 3600.0 if kinds else 0.0
    planned = list(failures.failures) if not kinds else []
    fixed = None
    while True:
        if kinds:
            at = t + rng.expovariate(rate)
            kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        elif planned:
            reached, kind, count, fixed = planned.pop(0)
            at = t + _wall_to_reach(s, reached - job.work)
        else:
            at = math.inf
        compute, blocking, usable = job.segment(t, min(at, wall_s))
        run.accounts["useful"] += compute
        run.accounts["snapshot blocking"] += blocking
        if at >= wall_s:
            break
        reached = job.work + compute
        lost_nodes = _victims(rng, kind, nodes, failures, count if not kinds else None)
        tier = _tier(s, job, kind, lost_nodes, at)
        restored = max(usable[tier], usable["disk"])  # the newest step complete in any tier wins
        lost = reached - restored
        run.accounts["useful"] -= lost
        run.accounts["recompute"] += lost
        restore_s = {"memory": s.restore_memory_s, "peers": s.restore_peers_s, "disk": s.restore_disk_s}[tier]
        parts = [("hang detection", restart.hang_timeout_s if kind == "hang" else 0.0)]
        if fixed is None:
            parts += [("detection", restart.detect_s), ("restart", restart.restart_s), (f"restore ({tier})", restore_s)]
            if lost_nodes:
                parts += s.node_loss
        else:
            parts.append(("restart", fixed))
        down = sum(seconds for _, seconds in parts)
        left = wall_s - at  # the run may end inside this recovery: only what came before the end counts
        for account, seconds in parts:
            run.accounts[account] += min(seconds, max(left, 0.0))
            left -= seconds
        run.failures[kind] += 1
        run.restores[tier] += 1
        run.lost_per_failure.append(lost + down)
        run.recomputed.append(lost)
        t = at + down
        if t >= wall_s:
            break
        job.work = restored
        job.disk = usable["disk"]
        job.protected_before = usable["peers"] if tier != "disk" else restored
        job.base_protected_at = t + s.protect_s
        job.recovered(t)
    return run


def _wall_to_reach(s: Strategy, compute: float) -> float:
    """Wall seconds a segment needs to compute `compute` seconds (snapshots block in between)."""
    if compute <= 0:
        return 0.0
    n = math.ceil(compute / s.interval_s) - 1  # snapshots taken before the work is reached
    return compute + n * s.blocking_s


def _victims(rng: random.Random, kind: str, nodes: int, failures, count: int | None) -> list[int]:
    if kind not in ("node", "correlated"):
        return []
    if count is None:
        count = failures.correlated_nodes if kind == "correlated" else 1
    count = min(count, nodes)
    first = rng.randrange(0, nodes - count + 1, count) if count > 1 else rng.randrange(nodes)
    return list(range(first, first + count))


def _tier(s: Strategy, job: _Job, kind: str, lost_nodes: list[int], at: float) -> str:
    if not s.in_memory:
        return "disk"
    if not lost_nodes:
        return "memory"
    return "peers" if job.lose(lost_nodes, at) else "disk"


@dataclass(frozen=True)
class Summary:
    strategy: str
    effective: float  # mean over seeds
    low: float  # 5th percentile over seeds
    high: float  # 95th percentile
    accounts: dict[str, float]  # mean share of the wall time
    failures: dict[str, float]  # mean count per run
    restores: dict[str, float]
    lost_per_failure_s: float  # mean over every failure of every seed


def summarize(s: Strategy, restart: Restart, nodes: int, wall_s: float, failures, seeds: int = 20) -> Summary:
    runs = [simulate(s, restart, nodes, wall_s, failures, seed) for seed in range(seeds)]
    eff = sorted(r.effective for r in runs)

    def mean_of(attr):
        keys = {k for r in runs for k in getattr(r, attr)}
        return {k: sum(getattr(r, attr)[k] for r in runs) / len(runs) for k in sorted(keys)}

    accounts = {k: sum(r.accounts[k] for r in runs) / len(runs) / wall_s for k in ACCOUNTS}
    losses = [x for r in runs for x in r.lost_per_failure]
    return Summary(s.name, statistics.fmean(eff), _quantile(eff, 0.05), _quantile(eff, 0.95), accounts,
                   mean_of("failures"), mean_of("restores"), statistics.fmean(losses) if losses else 0.0)


def _quantile(sorted_values: list[float], q: float) -> float:
    i = q * (len(sorted_values) - 1)
    lo = int(i)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (i - lo)
