"""Which nodes protect each other: erasure-coding groups of consecutive node ids.

Why consecutive nodes: launchers number ranks tensor-parallel fastest, then pipeline, then data
parallel, and place consecutive ranks on the same node. So consecutive nodes usually hold different
pipeline stages (or TP/PP shards) of one model replica: their snapshots are alike in size, which keeps
the padding to the group's largest node small, and a group never depends on two copies of the same
shard failing together. A layout that orders ranks otherwise passes its own group size.

The default group size is the largest divisor of the node count that is at most DEFAULT_MAX_GROUP:
bigger groups cost less parity memory (m/(G-m)) but make every rebuild read from G-m nodes and raise
the odds that more than m nodes of one group fail before the next snapshot (see `inmem-ft survival`).

After the job shrank onto the survivors of a node loss (or grew back), the groups are formed again over the
node ids that remain (`Groups.over`): consecutive survivors, at most G to a group where that leaves every group
more than m members, the sizes as even as the count allows (7 survivors of G=4 are groups of 4 and 3).
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
    """The job's node ids cut into EC groups (`sets`, each in position order), each tolerating `m` lost members."""

    sets: tuple[tuple[int, ...], ...]
    m: int

    @classmethod
    def consecutive(cls, nodes: int, size: int, m: int) -> Groups:
        """Nodes 0..nodes-1 in groups of `size`, as configured: the size must divide the node count."""
        if nodes < 1 or size < 1 or m < 1:
            raise ValueError(f"EC groups: nodes, group size and m must be >= 1, got nodes={nodes} size={size} m={m}")
        if nodes % size:
            fits = [g for g in range(m + 1, nodes + 1) if nodes % g == 0]
            raise ValueError(f"EC group size {size} does not divide the {nodes} nodes; pick a divisor "
                             f"of the node count greater than m={m}: one of {fits or 'none'}")
        if m >= size:
            raise ValueError(f"EC group size {size} must exceed m={m} (a group of G nodes survives at "
                             f"most G-1 losses); raise --group-size or lower --parity")
        return cls(tuple(tuple(range(first, first + size)) for first in range(0, nodes, size)), m)

    @classmethod
    def default(cls, nodes: int, m: int) -> Groups:
        return cls.consecutive(nodes, default_group_size(nodes, m), m)

    @classmethod
    def over(cls, ids, size: int, m: int) -> Groups | None:
        """Groups over the node ids `ids` (the survivors), at most `size` to a group where every group then has
        more than `m` members (else fewer, larger groups); None when `m` >= the number of nodes (no group can
        hold parity)."""
        ids = sorted(set(ids))
        if len(ids) <= m:
            return None
        count = min(-(-len(ids) // size), len(ids) // (m + 1))
        small, extra = divmod(len(ids), count)
        sets, at = [], 0
        for i in range(count):
            n = small + (i < extra)
            sets.append(tuple(ids[at: at + n]))
            at += n
        return cls(tuple(sets), m)

    @property
    def nodes(self) -> list[int]:
        return [n for s in self.sets for n in s]

    @property
    def largest(self) -> int:
        return max(len(s) for s in self.sets)

    def members(self, node: int) -> list[int]:
        """The node ids of `node`'s group, in position order (position = index in this list)."""
        for s in self.sets:
            if node in s:
                return list(s)
        raise ValueError(f"node {node} is not one of the job's nodes {self.nodes}")

    def position(self, node: int) -> int:
        return self.members(node).index(node)
