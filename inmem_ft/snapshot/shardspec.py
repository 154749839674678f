"""Where a stored tensor's elements sit in the model: the shard spec every resharding reader plans against.

A global tensor is named by a `key` that does not depend on the parallel layout (a Megatron layer-stacked
key, a DeepSpeed parameter name, `optimizer.state.exp_avg.<param>` for optimizer moments). A shard covers
a box of it (`offset` + `shape` inside `global_shape`), optionally only the row-major range `flat` of that
box (ZeRO partitions, distributed-optimizer bucket slices), and starts at element `at` of the stored
tensor (one flat buffer can hold the shards of many keys). `replica` are the coordinates of this copy
among identical ones; exactly one copy of every element is `main`, the one a loader reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...] | None = None
    """Box origin in the global tensor; default all zeros."""
    shape: tuple[int, ...] | None = None
    """Box extent; default the whole global tensor."""
    flat: tuple[int, int] | None = None
    """[lo, hi) in the row-major order of the box, when only part of the box is stored."""
    at: int = 0
    """Element offset of this shard inside the stored (flattened) tensor."""
    replica: tuple[int, ...] = ()
    main: bool = True
    prepend_axis_num: int = 0
    """Leading axes of global_shape that stack layers (Megatron), kept for exporting per-layer names."""
    axis_fragmentations: tuple[int, ...] | None = None

    def __post_init__(self):
        gs = tuple(int(d) for d in self.global_shape)
        offset = tuple(int(d) for d in self.offset) if self.offset is not None else (0,) * len(gs)
        shape = tuple(int(d) for d in self.shape) if self.shape is not None else gs
        for name, value in (("global_shape", gs), ("offset", offset), ("shape", shape)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "replica", tuple(int(r) for r in self.replica))
        if self.flat is not None:
            object.__setattr__(self, "flat", (int(self.flat[0]), int(self.flat[1])))
        if self.axis_fragmentations is not None:
            object.__setattr__(self, "axis_fragmentations", tuple(int(a) for a in self.axis_fragmentations))
        where = f"shard spec of {self.key!r}"
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"{where}: key must be a non-empty string")
        if not len(gs) == len(offset) == len(shape):
            raise ValueError(f"{where}: global_shape {gs}, offset {offset} and shape {shape} differ in rank")
        if any(o < 0 or s < 0 or o + s > g for g, o, s in zip(gs, offset, shape)):
            raise ValueError(f"{where}: box at {offset} of shape {shape} leaves global shape {gs}")
        box = math.prod(shape)
        if self.flat is not None and not 0 <= self.flat[0] <= self.flat[1] <= box:
            raise ValueError(f"{where}: flat range {self.flat} leaves the box's {box} elements")
        if self.at < 0:
            raise ValueError(f"{where}: at must be >= 0")

    @property
    def numel(self) -> int:
        """Elements this shard stores."""
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(self.shape)

    @property
    def box_numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        out = {"key": self.key, "global_shape": list(self.global_shape), "offset": list(self.offset),
               "shape": list(self.shape), "main": self.main}
        if self.flat is not None:
            out["flat"] = list(self.flat)
        if self.at:
            out["at"] = self.at
        if self.replica:
            out["replica"] = list(self.replica)
        if self.prepend_axis_num:
            out["prepend_axis_num"] = self.prepend_axis_num
        if self.axis_fragmentations is not None:
            out["axis_fragmentations"] = list(self.axis_fragmentations)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "ShardSpec":
        flat, af = d.get("flat"), d.get("axis_fragmentations")
        return cls(d["key"], tuple(d["global_shape"]), tuple(d["offset"]), tuple(d["shape"]),
                   tuple(flat) if flat is not None else None, d.get("at", 0), tuple(d.get("replica", ())),
                   d["main"], d.get("prepend_axis_num", 0), tuple(af) if af is not None else None)
