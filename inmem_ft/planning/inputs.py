"""What a plan starts from: the cluster, the job, how often and how things fail, and what our operations cost.

Every default names its source (SOURCES); docs/planning.md lists them. A value given on the command line, or
read from a benchmark's result file (`costs_from_results`), replaces the default.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from ..errors import ConfigError

GB, GIB = 1e9, float(1 << 30)

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4 and Table 5): 419 unexpected
# interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8).
LLAMA3_NODES, LLAMA3_GPUS_PER_NODE, LLAMA3_DAYS, LLAMA3_UNEXPECTED = 2048, 8, 54, 419


@dataclass(frozen=True)
class FailureModel:
    """Interruptions of the job: a rate per node and how they split by kind. `node` loses the node's memory
    (hardware: the node is drained), `crash` ends the processes but the node and its memory stay (software),
    `hang` stops progress until the detection timeout, `correlated` loses `correlated_nodes` nodes at once
    (a rack's switch)."""

    per_node_per_hour: float
    node: float
    crash: float
    hang: float
    correlated: float
    correlated_nodes: int = 2

    def __post_init__(self):
        if not self.per_node_per_hour > 0:
            raise ConfigError(f"failure rate per node must be > 0 per hour, got {self.per_node_per_hour}")
        shares = (self.node, self.crash, self.hang, self.correlated)
        if min(shares) < 0 or not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
            raise ConfigError(f"failure shares (node, crash, hang, correlated) must be >= 0 and add up to 1, got "
                              f"{shares} (sum {sum(shares):.3f})")
        if self.correlated_nodes < 1:
            raise ConfigError(f"--correlated-nodes must be >= 1, got {self.correlated_nodes}")

    @property
    def node_mtbf_hours(self) -> float:
        return 1.0 / self.per_node_per_hour

    def kinds(self) -> dict[str, float]:
        return {"node": self.node, "crash": self.crash, "hang": self.hang, "correlated": self.correlated}


def llama3_failures(**overrides) -> FailureModel:
    """Llama 3's published rate and causes. Shares: software bugs 12.9% are process crashes (the node's memory
    stays); NCCL watchdog timeouts 1.7% are hangs; network switch/cable 8.4% lose a rack (2 nodes of 8 GPUs:
    "each rack hosts 16 GPUs split between two servers"); every other cause (faulty GPU 30.1%, HBM3 17.2%, GPU
    SRAM 4.5%, GPU system processor 4.1%, host maintenance 7.6%, NIC 1.7%, silent data corruption 1.4%, the
    rest) is hardware of one host, counted as a lost node."""
    rate = LLAMA3_UNEXPECTED / (LLAMA3_NODES * LLAMA3_DAYS * 24)
    values = dict(per_node_per_hour=rate, crash=0.129, hang=0.017, correlated=0.084, node=1 - 0.129 - 0.017 - 0.084,
                  correlated_nodes=2)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return FailureModel(**values)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    host_memory: int | None = None  # bytes per node; None: not checked
    shm: int | None = None  # bytes of /dev/shm per node; None: not checked
    storage_gbps: float = 2000.0  # aggregate, GB/s (Llama 3: Tectonic, "2 TB/s sustained")

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.storage_gbps > 0:
            raise ConfigError(f"--storage-gbps must be > 0, got {self.storage_gbps}")


@dataclass(frozen=True)
class Job:
    """The training state per rank. From a model: bf16 weights (2 bytes/parameter) and fp32 master weights +
    Adam moments (12 bytes/parameter, a distributed optimizer), split over all ranks: the Megatron adapter stores
    a data-parallel-replicated shard once (Megatron's fully_parallel save), as the Snapshotter's dp_group does.
    `weights_per_replica`: every data-parallel replica snapshots its own copy of its TP x PP share of the
    weights instead (a plain Snapshotter without dp_group)."""

    bytes_per_rank: float
    checkpoint_bytes: float  # the job's unique state, what a disk checkpoint writes once
    step_s: float
    duration_days: float = LLAMA3_DAYS

    def __post_init__(self):
        for name in ("bytes_per_rank", "checkpoint_bytes", "step_s", "duration_days"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"job: {name.replace('_', ' ')} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_model(cls, params: float, tp: int, pp: int, dp: int, step_s: float, weight_bytes: int = 2,
                   optimizer_bytes: int = 12, weights_per_replica: bool = False, **kw) -> "Job":
        for name, v in (("params", params), ("tp", tp), ("pp", pp), ("dp", dp)):
            if not v >= 1:
                raise ConfigError(f"--{name} must be >= 1, got {v}")
        weights = weight_bytes * params / (tp * pp) / (1 if weights_per_replica else dp)
        optimizer = optimizer_bytes * params / (tp * pp * dp)
        return cls(weights + optimizer, (weight_bytes + optimizer_bytes) * params, step_s, **kw)


# Llama 3 405B's layout at 16,384 GPUs (Table 4): TP 8, CP 1, PP 16, DP 128; 16M tokens per step at 400
# TFLOPs per GPU gives 6 x 405e9 x 16e6 / (16,384 x 400e12) = 5.9 s per step.
LLAMA3_405B = dict(params=405e9, tp=8, pp=16, dp=128, step_s=5.9)


@dataclass(frozen=True)
class Costs:
    """What our operations cost. Rates are seconds per GiB of the bytes they move; slopes are seconds added per
    node of the job beyond `measured_nodes` (benchmarks/scaling.py --only nodes)."""

    blocking_s_per_gib: float = GIB / (52.8 * GB)  # one rank's copy out of its GPU (H100 D2H, 52.8 GB/s)
    # Measured on a 2-core CPU machine, every node an SMP on loopback (SOURCES names the result files;
    # tests/test_plan.py checks these against them).
    commit_s_per_gib: float = 0.0624
    protect_s_per_gib: float = 4.86
    restore_s_per_gib: float = 2.02
    rebuild_s_per_gib: float = 5.26
    detect_s: float = 0.295
    restart_s: float = 30.0
    hang_timeout_s: float = 60.0
    spare_arrival_s: float = 0.0  # how long a replacement for a lost node takes to join
    shrink_extra_s: float = 15.86  # what a shrink adds to a restart (SOURCES)
    # The SMPs' CPU seconds per node fell from 2 to 8 nodes: a falling slope is not extrapolated.
    protect_slope_s_per_node: float = 0.0
    commit_slope_s_per_node: float = 0.0
    restore_slope_s_per_node: float = 0.0
    measured_nodes: int = 2
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name, value in vars(self).items():
            if name != "sources" and (not isinstance(value, (int, float)) or value < 0 or math.isnan(value)):
                raise ConfigError(f"cost {name.replace('_', ' ')} must be a number >= 0, got {value!r}")

    def source(self, name: str) -> str:
        return self.sources.get(name) or SOURCES[name]

    def with_values(self, **values) -> "Costs":
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given, sources={**self.sources, **{k: "given on the command line" for k in given}})


# The result files the measured defaults come from (KEPT_RESULTS, relative to the repository).
SIZE_RESULT, NODES_RESULT, TIME_LOST_RESULT = ("benchmarks/results/scaling.json", "benchmarks/results/scaling_nodes.json",
                                               "benchmarks/results/time_lost.json")
SHRINK_RESULT = "benchmarks/results/time_lost_shrink.json"
KEPT_RESULTS = (SIZE_RESULT, NODES_RESULT, TIME_LOST_RESULT, SHRINK_RESULT)
_NODES = f"benchmarks/scaling.py --only nodes ({NODES_RESULT})"
_SLOPE = f"{_NODES}: least-squares SMP CPU seconds per added node over 2..8 nodes, 0 when it falls"

SOURCES = {
    "blocking_s_per_gib": "H100 device-to-host copy, 52.8 GB/s per GPU (nvbandwidth, public figure)",
    "commit_s_per_gib": f"benchmarks/scaling.py --quick ({SIZE_RESULT}): slope of commit time over the state size",
    "protect_s_per_gib": f"{_NODES}: commit -> protected, G=2 m=1, 2 nodes, loopback",
    "restore_s_per_gib": f"{_NODES}: a rank maps its slot, copies it out, verifies its checksum, 2 nodes",
    "rebuild_s_per_gib": f"{_NODES}: a replacement SMP rebuilt from its group, 2 nodes",
    "detect_s": f"benchmarks/time_lost.py ({TIME_LOST_RESULT}): detection of a killed rank by `inmem-ft run` "
                "(warm standbys) through the SLURM script",
    "restart_s": "assumption: a job-wide restart at scale (scheduling onto a spare node, process start, NCCL "
                 "init, which takes tens of seconds at 32K+ GPUs per NVIDIA/nccl PR 1789)",
    "hang_timeout_s": "inmem-ft launch --heartbeat-timeout default",
    "spare_arrival_s": "assumption: a spare node at hand; give your scheduler's time to bring one (the 'wait for a "
                       "spare' strategy waits it out at every node loss, 'shrink' trains on the survivors meanwhile)",
    "shrink_extra_s": f"benchmarks/time_lost.py --quick ({SHRINK_RESULT}): a node lost for good, 3 nodes: the time "
                      "lost by the shrink (spare wait, reshard) less that lost once a spare arrived (its arrival "
                      "taken out), side by side; what the shrink adds to a restart",
    "protect_slope_s_per_node": _SLOPE,
    "commit_slope_s_per_node": _SLOPE,
    "restore_slope_s_per_node": _SLOPE,
    "measured_nodes": f"{_NODES}: the smallest job measured",
}


def costs_from_results(paths: list[str], base: Costs | None = None) -> Costs:
    """Costs with what the given result files measured: benchmarks/scaling.py (size_slope, nodes, nodes_slope)
    and benchmarks/time_lost.py (the detection of a rank killed under `inmem-ft run` with warm standbys; a node
    lost for good, shrunk from against a spare waited for)."""
    costs = base or Costs()
    found: dict[str, float] = {}
    where: dict[str, str] = {}
    for path in paths:
        try:
            with open(path) as f:
                res = json.load(f)
        except OSError as e:
            raise ConfigError(f"--costs {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"--costs {path} is not JSON: {e}") from None
        got = _measured(res)
        if not got:
            raise ConfigError(f"--costs {path}: no figures this planner reads (a result of benchmarks/scaling.py "
                              f"or benchmarks/time_lost.py --json)")
        found.update(got)
        where.update(dict.fromkeys(got, f"measured: {path}"))
    return replace(costs, **found, sources={**costs.sources, **where})


def _measured(res: dict) -> dict[str, float]:
    out = {}
    if isinstance(res.get("size_slope"), dict) and "commit_s_per_GiB" in res["size_slope"]:
        out["commit_s_per_gib"] = max(res["size_slope"]["commit_s_per_GiB"], 0.0)
    rows = res.get("nodes")
    if isinstance(rows, list) and rows:
        first = min(rows, key=lambda r: r["nodes"])
        gib = first["node_bytes"] / GIB
        out.update(protect_s_per_gib=first["protect_s"] / gib, restore_s_per_gib=first["restore_s"] / gib,
                   rebuild_s_per_gib=first["rebuild_s"] / gib, measured_nodes=int(first["nodes"]))
        slope = res.get("nodes_slope", {})
        for key in ("protect", "commit", "restore"):
            if f"{key}_cpu_s_per_node" in slope:
                # Per-node CPU seconds, not wall: on a shared box every extra simulated node takes cores from the
                # others, which is the box's limit, not the job's. A falling slope is not extrapolated.
                out[f"{key}_slope_s_per_node"] = max(slope[f"{key}_cpu_s_per_node"], 0.0)
    loss = res.get("node_loss")
    spares = [v - float(k[len("spare_after_"):-len("_s")]) for k, v in (loss or {}).items()
              if k.startswith("spare_after_") and isinstance(v, (int, float))]
    if isinstance(loss, dict) and isinstance(loss.get("shrink_s"), (int, float)) and spares:
        out["shrink_extra_s"] = max(loss["shrink_s"] - sum(spares) / len(spares), 0.0)
    standby = res.get("standby")
    if isinstance(standby, dict) and isinstance(standby.get("parts"), dict) and standby["parts"].get("detection"):
        out["detect_s"] = standby["parts"]["detection"]
    return out
