"""The parallel layout a snapshot was taken under: what a loader on another layout needs to map it.

One record per rank's manifest. Job-wide facts (sizes, framework, optimizer) are the same on every rank;
`coords` are this rank's. `position` is the data position (consumed samples, or whatever the framework
counts) and `param_groups` say which global key is in which optimizer group, with its hyperparameters.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

_SIZES = ("tp", "pp", "dp", "ep", "vpp")
# What makes two snapshots' layouts the same: a rank can load a snapshot of its own layout as it is; any
# other needs resharding.
_LAYOUT = ("framework", "world_size", *_SIZES, "zero_stage")


@dataclass
class Topology:
    framework: str = "pytorch"
    """'pytorch' (plain API), 'deepspeed' or 'megatron'."""
    framework_version: str | None = None
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    vpp: int = 1
    coords: dict = field(default_factory=dict)
    """This rank's coordinates, e.g. {"tp": 0, "pp": 1, "dp": 0}."""
    zero_stage: int | None = None
    position: object = None
    optimizer: dict | None = None
    """{"type": "Adam", "param_groups": [{"keys": [...], "lr": ..., ...}]}"""

    def __post_init__(self):
        for name in ("world_size", *_SIZES):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"topology: {name} must be an integer >= 1, got {value!r}")
        bad = {k: v for k, v in self.coords.items() if not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"topology: coordinates must be integers >= 0, got {bad}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def plain(cls, world_size: int, dp: int = 1, dp_rank: int = 0) -> "Topology":
        """The record of a plain PyTorch job: its world and data-parallel sizes only."""
        return cls(world_size=world_size, dp=dp, coords={"dp": dp_rank})

    @classmethod
    def from_json(cls, d: dict) -> "Topology":
        return cls(**d)

    def layout(self) -> str:
        """A short readable layout, for log lines: tp2.pp1.dp4 (with .zero1 for DeepSpeed ZeRO)."""
        parts = [f"{n}{getattr(self, n)}" for n in ("tp", "pp", "dp") + (("ep",) if self.ep > 1 else ())]
        return ".".join(parts + ([f"zero{self.zero_stage}"] if self.zero_stage is not None else []))

    def layout_key(self) -> tuple:
        return tuple(getattr(self, n) for n in _LAYOUT)


def layout_key(topology: dict) -> tuple:
    """Topology.layout_key of a manifest's topology record (JSON), without building one."""
    defaults = Topology()
    return tuple(topology.get(n, getattr(defaults, n)) for n in _LAYOUT)


_SCALARS = (int, float, str, bool, type(None))


def hyperparameters(group: dict) -> dict:
    """An optimizer param group's JSON-plain hyperparameters for the record (betas as a list); its params and
    anything that is not plain data (a tensor-valued lr, say) stay out: they live in the state itself."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, _SCALARS):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
            out[key] = list(value)
    return out
