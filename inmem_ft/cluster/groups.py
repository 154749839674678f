"""Which nodes protect each other: erasure-coding groups of G consecutive node ids.

Why consecutive nodes: launchers number ranks tensor-parallel fastest, then pipeline, then data
parallel, and place consecutive ranks on the same node. So consecutive nodes usually hold different
pipeline stages (or TP/PP shards) of one model replica: their snapshots are alike in size, which keeps
the padding to the group's largest node small, and a group never depends on two copies of the same
shard failing together. A layout that orders ranks otherwise passes its own group size.

The default group size is the largest divisor of the node count that is at most DEFAULT_MAX_GROUP:
bigger groups cost less parity memory (m/(G-m)) but make every rebuild read from G-m nodes and raise
the odds that more than m nodes of one group fail before the next snapshot (see `inmem-ft survival`).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_GROUP = 8


def default_group_size(nodes: int, m: int) -> int:
    sizes = [g for g in range(m + 1, min(nodes, DEFAULT_MAX_GROUP) + 1) if nodes % g == 0]
    if not sizes:
        raise ValueError(f"{nodes} nodes cannot form erasure-coding groups tolerating m={m} lost nodes: a group "
                         f"needs more than m nodes and must divide the node count; lower m or add nodes")
    return max(sizes)


@dataclass(frozen=True)
class Groups:
    nodes: int
    size: int  # G
    m: int

    def __post_init__(self):
        if self.nodes < 1 or self.size < 1 or self.m < 1:
            raise ValueError(f"EC groups: nodes, group size and m must be >= 1, got {self}")
        if self.nodes % self.size:
            fits = [g for g in range(self.m + 1, self.nodes + 1) if self.nodes % g == 0]
            raise ValueError(f"EC group size {self.size} does not divide the {self.nodes} nodes; pick a divisor "
                             f"of the node count greater than m={self.m}: one of {fits or 'none'}")
        if self.m >= self.size:
            raise ValueError(f"EC group size {self.size} must exceed m={self.m} (a group of G nodes survives at "
                             f"most G-1 losses); raise --group-size or lower --parity")

    @classmethod
    def default(cls, nodes: int, m: int) -> "Groups":
        return cls(nodes, default_group_size(nodes, m), m)

    def members(self, node: int) -> list[int]:
        """The node ids of `node`'s group, in position order (position = index in this list)."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} is outside 0..{self.nodes - 1}")
        first = node - node % self.size
        return list(range(first, first + self.size))

    def position(self, node: int) -> int:
        return self.members(node).index(node)
