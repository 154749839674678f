"""The typed, validated configuration every entry point (Python API, DeepSpeed block, CLI) builds.

Values are checked here, at the edge, so a bad setting fails at start with a message naming the key,
the value and what is allowed, instead of deep inside a training step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .deprecation import deprecated
from .errors import ConfigError
from .globalbatch import ON_SHRINK
from .smp import paths
from .units import parse_size

ON_ERROR = ("warn", "raise")
RESHARD = ("auto", "never")


AUTO_MEANS_A_VALUE = ("reshard",)  # keys whose own values include "auto"


def _from_dict(cls, values, where: str):
    """Build a config dataclass from user data; unknown keys fail with the list of known ones."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a JSON object, got {type(values).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")
    auto = sorted(k for k, v in values.items() if v == "auto" and k not in AUTO_MEANS_A_VALUE)
    if auto:
        # accelerate's filler would stop on them with "not found in kwargs": no framework knows these values
        raise ConfigError(f"{where}: {auto} = \"auto\": nothing fills inmem_ft's values (they are not the "
                          f"framework's); give each a value, or leave the key out for its default")
    return cls(**values)


def _env_node() -> int:
    # torchrun exports the node's index as GROUP_RANK, SLURM as SLURM_NODEID.
    for var in ("INMEM_FT_NODE", "GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@dataclass(frozen=True)
class SnapshotConfig:
    interval: int = 100
    """Take a snapshot every this many steps."""
    job: str = "default"
    """Job id: names the SMP socket and segments, so two jobs on a node never mix."""
    node: int = 0
    """This node's index; picks the local SMP."""
    smp_socket: str | None = None
    """Path of the local SMP's socket; default <runtime dir>/<job>/node<node>.sock."""
    staging_budget: int | None = None
    """Pinned host bytes for staging GPU copies (CUDA only); None = as large as one rank's shard."""
    on_error: str = "warn"
    """On a failed snapshot (SMP gone, budget): 'warn' keeps training, 'raise' stops it."""
    timeout_s: float = 600.0
    """How long ranks wait for each other when agreeing on a snapshot."""
    start_fresh: bool = False
    """Train from scratch when the SMPs hold snapshots of a completed step that cannot be restored on every
    rank (default: fail and say why, keeping them)."""
    sentinel_steps: int = 20
    """Steps after a restore whose loss (and gradient norm) are screened: a NaN/Inf, or a loss above the bound
    learned from the losses the snapshot recorded, marks the restored step bad (capture/sentinel.py); 0: off."""
    fingerprint_every: int = 10
    """Every this many snapshots, the data-parallel replicas compare fingerprints of the replicated bytes they
    hold; a mismatch names the ranks, marks the step bad and stops the ranks (capture/fingerprint.py); 0: off."""

    def __post_init__(self):
        def bad(key, msg):
            raise ConfigError(f"inmem_ft config: '{key}' = {getattr(self, key)!r}: {msg}")

        if not isinstance(self.interval, int) or isinstance(self.interval, bool) or self.interval < 1:
            bad("interval", "must be an integer number of steps >= 1")
        try:
            paths.check_job(self.job)
        except ValueError as e:
            bad("job", str(e))
        if not isinstance(self.node, int) or self.node < 0:
            bad("node", "must be a non-negative integer")
        if self.staging_budget is not None:
            try:
                object.__setattr__(self, "staging_budget", parse_size(self.staging_budget))
            except ValueError as e:
                bad("staging_budget", str(e))
        if self.on_error not in ON_ERROR:
            bad("on_error", f"must be one of {ON_ERROR}")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            bad("timeout_s", "must be a positive number of seconds")
        if not isinstance(self.start_fresh, bool):
            bad("start_fresh", "must be true or false")
        if not _is_int(self.sentinel_steps) or self.sentinel_steps < 0:
            bad("sentinel_steps", "must be an integer >= 0 (steps screened after a restore; 0 turns the check off)")
        if not _is_int(self.fingerprint_every) or self.fingerprint_every < 0:
            bad("fingerprint_every", "must be an integer >= 0 (snapshots between replica comparisons; 0 turns them "
                                     "off)")

    @property
    def socket_path(self) -> str:
        return self.smp_socket or paths.default_socket(self.job, self.node)

    @classmethod
    def from_dict(cls, values: dict, where: str = "inmem_ft") -> "SnapshotConfig":
        return _from_dict(cls, values, where)

    @classmethod
    def from_env(cls, **overrides) -> "SnapshotConfig":
        """Defaults filled from the variables the launch scripts export, then `overrides`."""
        env = {"job": os.environ.get("INMEM_FT_JOB"), "smp_socket": os.environ.get("INMEM_FT_SMP_SOCKET"),
               "node": _env_node(), "start_fresh": os.environ.get("INMEM_FT_START_FRESH") == "1" or None}
        merged = {k: v for k, v in env.items() if v is not None}
        merged.update(overrides)
        return cls.from_dict(merged)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class InmemFTBlock:
    """The `"inmem_ft": {...}` block of a framework config (DeepSpeed JSON), shared by the trainer-side
    adapter and, for its SMP-side keys (memory_budget, group_size, parity, persist_*), by `inmem-ft smp start`.

    Erasure coding is RS(k, m) over groups of G = k + m nodes: `group_size` is G, `parity` is m, as for
    `inmem-ft smp start --group-size/--parity` and `inmem-ft survival -G/-m`."""

    enabled: bool = True
    """false: the adapter leaves the engine as it is (no snapshots, no restore)."""
    interval: int = 100
    """Snapshot every this many optimizer steps."""
    job: str | None = None
    """Job id; default $INMEM_FT_JOB, else 'default'."""
    smp_socket: str | None = None
    """Local SMP socket; default $INMEM_FT_SMP_SOCKET, else derived from job and node."""
    memory_budget: int | str | None = None
    """SMP-side: bytes of shared memory the node's SMP may hold (e.g. "8GiB")."""
    group_size: int | None = None
    """SMP-side: erasure-code group size G = k + m, the nodes per group (k data, m parity per stripe)."""
    parity: int = 0
    """SMP-side: erasure-code parity m (node losses per group survived)."""
    persist_dir: str | None = None
    """SMP-side: the disk tier's directory; the SMP flushes its node's slots there (smp/disktier.py), on SIGTERM
    too, and starts from them when shared memory holds nothing. None = no disk tier."""
    persist_every_steps: int | None = None
    """SMP-side: flush each complete step that is a multiple of this many training steps to persist_dir (a
    multiple of `interval`); 0/None = only on SIGTERM. Replaces `persist_every`, which counted snapshots."""
    persist_keep: int = 2
    """SMP-side: flushed steps each node keeps on disk."""
    on_error: str = "warn"
    staging_budget: int | str | None = None
    timeout_s: float = 600.0
    start_fresh: bool | None = None
    """Train from scratch when snapshots of a completed step cannot be restored (default: fail, keep them)."""
    reshard: str = "auto"
    """A job back on another layout (DP size, ZeRO stage): 'auto' rebuilds each rank's state from the old
    layout's snapshots; 'never' stops with LayoutMismatch instead."""
    on_shrink: str = "keep"
    """The data-parallel size changed (a node lost for good, one taken back) and the global batch does not divide
    by micro batch x DP: 'keep' trains with the nearest gradient accumulation and says the new global batch,
    'refuse' waits for a node to join instead (under `inmem-ft run`; globalbatch.py)."""
    partition_dims: dict | None = None
    """Tensor parallelism: {pattern: dim or null} for the parameters whose module does not mark how they are
    split (Megatron's `tensor_model_parallel`/`partition_dim` attributes). A pattern (fnmatch) matches the
    parameter's module name or its shard-map key; dim is the one its TP slices are cut along, null: the same
    on every TP rank. The first matching pattern applies."""
    sentinel_steps: int = 20
    """Steps after a restore whose loss (and gradient norm) are screened for NaN/Inf or a spike; a trip marks the
    restored step bad and the job resumes from an older one once restarted (capture/sentinel.py); 0: off."""
    fingerprint_every: int = 10
    """Every this many snapshots the data-parallel replicas compare fingerprints of the replicated bytes they hold
    (capture/fingerprint.py); 0: off."""
    allow_untested: bool = False
    """Run on a DeepSpeed / megatron-core release outside inmem_ft.compat's tested range, with a warning
    (as $INMEM_FT_ALLOW_UNTESTED=1 does); by default such a release is refused at start."""

    def __post_init__(self):
        def bad(key, msg):
            raise ConfigError(f"inmem_ft config: '{key}' = {getattr(self, key)!r}: {msg}")

        for key in ("enabled", "allow_untested"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be true or false")
        if self.job is not None:
            try:
                paths.check_job(self.job)
            except ValueError as e:
                bad("job", str(e))
        if self.smp_socket is not None and (not isinstance(self.smp_socket, str) or not self.smp_socket):
            bad("smp_socket", "must be a path")
        if self.memory_budget is not None:
            try:
                object.__setattr__(self, "memory_budget", parse_size(self.memory_budget))
            except ValueError as e:
                bad("memory_budget", str(e))
        if not _is_int(self.parity) or self.parity < 0:
            bad("parity", "must be an integer >= 0")
        if self.group_size is not None and (not _is_int(self.group_size) or self.group_size <= self.parity
                                            or self.group_size < 2):
            bad("group_size", f"must be an integer >= 2 and > parity ({self.parity}): the nodes per erasure-code "
                              f"group, G = k + m")
        if self.parity and self.group_size is None:
            bad("parity", "needs 'group_size' (G = k + m, the nodes per erasure-code group)")
        every = self.persist_every_steps
        if every is not None and (not _is_int(every) or every < 0):
            bad("persist_every_steps", "must be an integer >= 0 (training steps; 0 or null: flush only on SIGTERM)")
        if self.persist_dir is not None and (not isinstance(self.persist_dir, str) or not self.persist_dir):
            bad("persist_dir", "must be a directory path")
        if not _is_int(self.persist_keep) or self.persist_keep < 1:
            bad("persist_keep", "must be an integer >= 1 (flushed steps each node keeps)")
        if every and not self.persist_dir:
            bad("persist_every_steps", "needs 'persist_dir'")
        if every and _is_int(self.interval) and self.interval > 0 and every % self.interval:
            bad("persist_every_steps", f"must be a multiple of 'interval' ({self.interval}): only snapshot steps "
                                       f"can be flushed")
        if self.reshard not in RESHARD:
            bad("reshard", f"must be one of {RESHARD}")
        if self.on_shrink not in ON_SHRINK:
            bad("on_shrink", f"must be one of {ON_SHRINK}")
        if self.partition_dims is not None and not (
                isinstance(self.partition_dims, dict)
                and all(isinstance(k, str) and k and (v is None or _is_int(v) and v >= 0)
                        for k, v in self.partition_dims.items())):
            bad("partition_dims", "must map parameter-name patterns to a dim (an integer >= 0) or null")
        self.snapshot_config()  # interval, on_error, staging_budget, timeout_s: checked where they live

    @property
    def persist(self) -> bool:
        return bool(self.persist_dir and self.persist_every_steps)

    def snapshot_config(self, **env_overrides) -> SnapshotConfig:
        """The trainer-side SnapshotConfig: this block's values over what the launch scripts export."""
        mine = {"interval": self.interval, "on_error": self.on_error, "timeout_s": self.timeout_s,
                "staging_budget": self.staging_budget, "job": self.job, "smp_socket": self.smp_socket,
                "start_fresh": self.start_fresh, "sentinel_steps": self.sentinel_steps,
                "fingerprint_every": self.fingerprint_every}
        return SnapshotConfig.from_env(**{k: v for k, v in mine.items() if v is not None}, **env_overrides)

    @classmethod
    def from_dict(cls, values, where: str = "inmem_ft") -> "InmemFTBlock":
        if isinstance(values, dict) and "persist_every" in values:
            values = _old_persist_every(values, where)
        return _from_dict(cls, values, where)

    @classmethod
    def from_framework_config(cls, config: dict, key: str = "inmem_ft") -> "InmemFTBlock | None":
        """The block under `key` of a whole (DeepSpeed) config dict, or None if there is none."""
        if key not in config:
            return None
        return cls.from_dict(config[key], where=key)


def _old_persist_every(values: dict, where: str) -> dict:
    """The block with the old `persist_every` (counted in snapshots) as `persist_every_steps`."""
    values = dict(values)
    old = values.pop("persist_every")
    if "persist_every_steps" in values:
        raise ConfigError(f"{where}: give 'persist_every_steps' only ('persist_every' is its old name)")
    interval = values.get("interval", InmemFTBlock.interval)
    if old is not None and (not _is_int(old) or old < 0 or not _is_int(interval)):
        raise ConfigError(f"inmem_ft config: 'persist_every' = {old!r}: must be an integer >= 0 (snapshots)")
    values["persist_every_steps"] = None if old is None else old * interval
    deprecated(f"'persist_every' ({old} snapshots) in {where}", f"'persist_every_steps' "
               f"({values['persist_every_steps']}, counted in training steps)")
    return values
