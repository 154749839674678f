"""The typed, validated configuration every entry point (Python API, DeepSpeed block, CLI) builds.

Values are checked here, at the edge, so a bad setting fails at start with a message naming the key,
the value and what is allowed, instead of deep inside a training step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .errors import ConfigError
from .smp import paths
from .units import parse_size

ON_ERROR = ("warn", "raise")


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

    @property
    def socket_path(self) -> str:
        return self.smp_socket or paths.default_socket(self.job, self.node)

    @classmethod
    def from_dict(cls, values: dict, where: str = "inmem_ft") -> "SnapshotConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_env(cls, **overrides) -> "SnapshotConfig":
        """Defaults filled from the variables the launch scripts export, then `overrides`."""
        env = {"job": os.environ.get("INMEM_FT_JOB"), "smp_socket": os.environ.get("INMEM_FT_SMP_SOCKET"),
               "node": _env_node()}
        if os.environ.get("INMEM_FT_INTERVAL"):
            env["interval"] = int(os.environ["INMEM_FT_INTERVAL"])
        merged = {k: v for k, v in env.items() if v is not None}
        merged.update(overrides)
        return cls.from_dict(merged)
