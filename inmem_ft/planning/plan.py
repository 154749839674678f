"""The recommendation: snapshot interval, EC group and parity, disk-tier cadence and memory per node, and the
effective training time it buys next to disk checkpoints and full in-memory replication.

- interval: Young/Daly, sqrt(2 x blocking x job MTBF), at least the time to protect a snapshot (the SMP cannot
  protect snapshots faster than that) and one step;
- G and m: the least parity memory m/(G-m) whose chance of losing more than m nodes of a group while a snapshot
  is being protected (`planning.survival`), summed over the run, stays under the target, and whose rebuilds
  (k x a node's bytes read) cost little beyond the restart they overlap; groups must span racks, so a lost
  rack costs each group at most one node;
- persist_every: flush to disk about every `max_disk_age_s`, never more often than the storage can take (twice
  the flush time): what losses beyond m, or of every node, fall back to;
- memory per node: two slots per rank (committed + in flight), parity m/(G-m) of the node's slots twice (the
  old and the new overlap while a snapshot is encoded: cluster/protection.py). A GPU job's copies go straight
  into the slots, registered with the device (capture/copier.py): no staging beside them, but the slots'
  bytes are locked memory, which the ranks' `ulimit -l` must allow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import survival
from ..config import InmemFTBlock
from ..errors import ConfigError
from ..units import human
from . import simulate
from .inputs import GB, GIB, Cluster, Costs, FailureModel, Job

SLOTS_PER_RANK = 2  # smp/daemon.py: one committed + one being written
PARITY_SETS = 2  # cluster/protection.py: old and new parity overlap while encoding
MAX_GROUP = 16
MAX_PARITY = 3


@dataclass(frozen=True)
class Targets:
    beyond_m_per_run: float = 0.01  # expected losses of more than m nodes of a group, over the whole run
    rebuild_share: float = 0.001  # of the run, spent rebuilding beyond what hides behind the restarts
    max_disk_age_s: float = 3600.0
    seeds: int = 20


@dataclass(frozen=True)
class Memory:
    slots: float
    parity: float
    locked: float
    """Of the slots, the bytes a GPU job registers with the device (all of them): within /dev/shm, not beside it."""

    @property
    def shm(self) -> float:
        return self.slots + self.parity


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    job: Job
    failures: FailureModel
    costs: Costs
    targets: Targets
    interval_steps: int
    group_size: int
    parity: int
    beyond_m_per_run: float
    persist_every: int
    memory: Memory
    replication_memory: float
    strategies: tuple[simulate.Strategy, ...]
    results: tuple[simulate.Summary, ...]
    restart: simulate.Restart

    @property
    def node_bytes(self) -> float:
        return self.job.bytes_per_rank * self.cluster.gpus_per_node

    @property
    def interval_s(self) -> float:
        return self.interval_steps * self.job.step_s


def job_mtbf_s(cluster: Cluster, failures: FailureModel) -> float:
    return 3600.0 / (cluster.nodes * failures.per_node_per_hour)


def node_loss_mtbf_hours(failures: FailureModel) -> float:
    """Hours between losses of one given node: alone, or in a correlated loss (spread over different groups)."""
    return 1.0 / (failures.per_node_per_hour * (failures.node + failures.correlated * failures.correlated_nodes))


def young_daly(blocking_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * blocking_s * mtbf_s)


def our_costs(cluster: Cluster, job: Job, costs: Costs, group_size: int = 2, parity: int = 1) -> dict[str, float]:
    """Seconds of each operation at this job's size: per-rank work (the copy out of the GPU, commit, restore)
    runs on every rank at once; protection pulls m x the node's bytes into each node (k chunks for each of its m
    parity chunks, each 1/k of a node), a rebuild k x the lost node's bytes (k chunks for each chunk it lacks);
    the rates were measured at G=2, m=1 (both 1 x the node), so they scale by m and by k. Plus the measured
    growth per node beyond the benchmark's job."""
    rank_gib = job.bytes_per_rank / GIB
    node_gib = rank_gib * cluster.gpus_per_node
    k = group_size - parity
    extra = max(cluster.nodes - costs.measured_nodes, 0)
    commit = rank_gib * costs.commit_s_per_gib + costs.commit_slope_s_per_node * extra
    restore = rank_gib * costs.restore_s_per_gib + costs.restore_slope_s_per_node * extra
    # Every node's SMP flushes its own slots; together they share the storage.
    flush = cluster.nodes * node_gib * GIB / (cluster.storage_gbps * GB)
    return {"blocking": rank_gib * costs.blocking_s_per_gib, "commit": commit,
            "protect": commit + parity * node_gib * costs.protect_s_per_gib + costs.protect_slope_s_per_node * extra,
            "restore": restore, "rebuild": k * node_gib * costs.rebuild_s_per_gib, "flush": flush}


def choose_group(cluster: Cluster, job: Job, failures: FailureModel, costs: Costs, interval_s: float,
                 wall_s: float, targets: "Targets") -> tuple[int, int, float]:
    """(G, m, expected losses beyond m over the run). Among the groups whose chance of losing more than m nodes
    while a snapshot is protected (planning.survival), summed over the run, meets the target, and whose rebuilds
    cost at most `targets.rebuild_share` of the run beyond what hides behind the job's restart (a replacement
    rebuilds while the ranks restart; a rebuild reads k x the node): the least parity memory, then the smaller
    group. None meets both: the safest of those meeting the survival target with the fastest rebuild."""
    mtbf_h = node_loss_mtbf_hours(failures)
    losses = wall_s * cluster.nodes * failures.per_node_per_hour / 3600.0 * (failures.node + failures.correlated)
    candidates = []
    for g in range(2, min(MAX_GROUP, cluster.nodes) + 1):
        if cluster.nodes % g or cluster.nodes // g < failures.correlated_nodes:
            continue  # must divide the nodes, and leave as many groups as a rack has nodes (groups span racks)
        for m in range(1, min(MAX_PARITY, g - 1) + 1):
            ours = our_costs(cluster, job, costs, g, m)
            window = max(interval_s, ours["protect"]) + ours["protect"]
            inp = survival.Inputs(cluster.nodes, g, m, mtbf_h, window)
            p = survival.ec_risk(inp, survival.node_failure_probability(window, mtbf_h)).p_loss
            rebuild_share = losses * max(ours["rebuild"] - costs.restart_s, 0.0) / wall_s
            candidates.append((m / (g - m), g, m, p * wall_s / window, rebuild_share))
    if not candidates:
        raise ConfigError(f"{cluster.nodes} nodes form no EC group of 2..{MAX_GROUP} nodes that divides them and "
                          f"leaves at least {failures.correlated_nodes} groups (one per node of a rack, "
                          f"--correlated-nodes): choose a node count with such a divisor, or fewer --correlated-nodes")
    safe = [c for c in candidates if c[3] <= targets.beyond_m_per_run]
    if not safe:
        best = min(candidates, key=lambda c: c[3])
    else:
        cheap = [c for c in safe if c[4] <= targets.rebuild_share]
        best = min(cheap, key=lambda c: (c[0], c[1])) if cheap else min(safe, key=lambda c: (c[4], c[0]))
    return best[1], best[2], best[3]


def memory(job: Job, cluster: Cluster, group_size: int, parity: int) -> Memory:
    node = job.bytes_per_rank * cluster.gpus_per_node
    return Memory(slots=SLOTS_PER_RANK * node, parity=PARITY_SETS * node * parity / (group_size - parity),
                  locked=SLOTS_PER_RANK * node)


def make_plan(cluster: Cluster, job: Job, failures: FailureModel, costs: Costs, targets: Targets = Targets(),
              disk_interval_s: float | None = None) -> Plan:
    wall_s = job.duration_days * 86400.0
    mtbf = job_mtbf_s(cluster, failures)
    blocking = our_costs(cluster, job, costs)["blocking"]
    g, m, beyond = choose_group(cluster, job, failures, costs, max(young_daly(blocking, mtbf), job.step_s), wall_s,
                                targets)
    ours = our_costs(cluster, job, costs, g, m)
    steps = max(1, round(max(young_daly(ours["blocking"], mtbf), job.step_s) / job.step_s),
                math.ceil(ours["protect"] / job.step_s))
    interval_s = steps * job.step_s
    disk_age = max(2 * ours["flush"], min(targets.max_disk_age_s, wall_s))
    persist_every = max(1, math.ceil(disk_age / interval_s))
    mem = memory(job, cluster, g, m)
    restart = simulate.Restart(costs.detect_s, costs.restart_s, costs.hang_timeout_s)
    waiting = inmem_strategy(ours, restart.restart_s, interval_s, g, m, persist_every, costs.spare_arrival_s)
    # Every strategy but the shrink waits for a spare at a node loss.
    spare = (("spare wait", costs.spare_arrival_s),)
    strategies = (waiting, replace(disk_strategy(cluster, job, mtbf, disk_interval_s), node_loss=spare),
                  replace(replication_strategy(cluster, job, our_costs(cluster, job, costs), restart.restart_s,
                                               persist_every, mtbf), node_loss=spare),
                  shrink_strategy(waiting, cluster, costs, restart.restart_s, ours["restore"]))
    results = tuple(simulate.summarize(s, restart, cluster.nodes, wall_s, failures, targets.seeds)
                    for s in strategies)
    # Replication's copies overlap as parity sets do: the partner keeps the old copy until the new one is whole.
    replicated = (SLOTS_PER_RANK + PARITY_SETS) * job.bytes_per_rank * cluster.gpus_per_node
    return Plan(cluster, job, failures, costs, targets, steps, g, m, beyond, persist_every, mem, replicated,
                strategies, results, restart)


def inmem_strategy(ours: dict, restart_s: float, interval_s: float, g: int, m: int,
                   persist_every: int, spare_arrival_s: float = 0.0) -> simulate.Strategy:
    """A lost node waits for a spare (`spare_arrival_s`); the replacement rebuilds while the job restarts, and its
    ranks restore once it is done."""
    return simulate.Strategy(
        f"in-memory EC, wait for a spare (inmem_ft, G={g}, m={m})", interval_s, ours["blocking"], ours["commit"],
        ours["protect"], persist_every, ours["commit"] + ours["flush"], ours["restore"],
        max(ours["rebuild"] - restart_s, 0.0) + ours["restore"], ours["flush"] + ours["restore"], group_size=g,
        tolerate=m, node_loss=(("spare wait", spare_arrival_s),))


def shrink_strategy(waiting: simulate.Strategy, cluster: Cluster, costs: Costs, restart_s: float,
                    restore_s: float) -> simulate.Strategy:
    """The same snapshots, but a lost node is trained without (`inmem-ft run --nnodes MIN:MAX`): the restart
    onto the survivors costs the measured shrink's extra beyond a restart; the job then runs at (N-1)/N of its
    rate (data parallel, the global batch kept) until the spare arrives, and grows back at the next snapshot
    (one more restart, restored from memory, nothing computed again)."""
    return replace(waiting, name=waiting.name.replace("wait for a spare", "shrink onto the survivors"), node_loss=(
        ("shrink", costs.shrink_extra_s), ("shrunk (fewer nodes)", costs.spare_arrival_s / cluster.nodes),
        ("grow", restart_s + restore_s)))


def disk_strategy(cluster: Cluster, job: Job, mtbf_s: float, interval_s: float | None = None) -> simulate.Strategy:
    """Synchronous checkpoints of the job's unique state to shared storage, read back after every failure."""
    write = job.checkpoint_bytes / (cluster.storage_gbps * GB)
    if interval_s is None:
        interval_s = max(young_daly(write, mtbf_s), job.step_s)
    interval_s = max(1, round(interval_s / job.step_s)) * job.step_s
    return simulate.Strategy("disk checkpoints", interval_s, write, 0.0, 0.0, 1, 0.0, write, write, write,
                             in_memory=False)


def replication_strategy(cluster: Cluster, job: Job, ours: dict, restart_s: float, persist_every: int,
                         mtbf_s: float) -> simulate.Strategy:
    """A full copy of each node's snapshot on one partner node (nvidia-resiliency-ext's local checkpoints,
    Gemini): the same copy out of the GPU and commit, then the node's bytes to its partner, at the rate our
    protection moves a node's bytes at G=2, m=1 (the same traffic); a lost node's copy comes back at our
    rebuild rate with k=1."""
    interval_s = max(1, round(max(young_daly(ours["blocking"], mtbf_s), job.step_s) / job.step_s),
                     math.ceil(ours["protect"] / job.step_s)) * job.step_s
    return simulate.Strategy(
        "full replication (NVRx/Gemini style, x1)", interval_s, ours["blocking"], ours["commit"], ours["protect"],
        persist_every, ours["commit"] + ours["flush"], ours["restore"],
        max(ours["rebuild"] - restart_s, 0.0) + ours["restore"], ours["flush"] + ours["restore"], group_size=2,
        tolerate=1)


def config_block(plan: Plan, persist_dir: str) -> dict:
    """The `inmem_ft` block, checked by the config class the trainers and `smp start --config` use. group_size is
    what `smp start --config` hands the SMP as --group-size: the nodes of a group, G."""
    budget_gib = math.ceil(plan.memory.shm * 1.05 / GIB)  # 5% for manifests and headers
    block = {"enabled": True, "interval": plan.interval_steps, "memory_budget": f"{budget_gib}GiB",
             "group_size": plan.group_size, "parity": plan.parity, "persist_dir": persist_dir,
             "persist_every_steps": plan.persist_every * plan.interval_steps}
    InmemFTBlock.from_dict(block)
    return block


def megatron_args(plan: Plan, config_path: str) -> str:
    return f"--inmem-ft --inmem-ft-interval {plan.interval_steps} --inmem-ft-config {config_path}"


def fits(plan: Plan) -> list[str]:
    """Lines saying whether the memory fits the node's /dev/shm and host memory, where they were given."""
    out = []
    c, mem = plan.cluster, plan.memory
    if c.shm is not None:
        ok = mem.shm * 1.05 <= c.shm
        out.append(f"/dev/shm: needs {human(mem.shm * 1.05)} of {human(c.shm)}: {'fits' if ok else 'DOES NOT FIT'}")
    if c.host_memory is not None:
        ok = mem.shm * 1.05 <= c.host_memory
        out.append(f"host memory: needs {human(mem.shm * 1.05)} (the /dev/shm above) of "
                   f"{human(c.host_memory)}: {'fits' if ok else 'DOES NOT FIT'}")
    return out
