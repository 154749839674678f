"""Replica fingerprints: every K-th snapshot, the data-parallel replicas compare what they hold of the replicated
region, so that a rank whose copy of the weights silently changed (a bit flipped by a bad GPU or host) is caught
before its snapshot is trusted.

Each replica stores only its share of the region (snapshot/layout.py), so no two snapshots hold the same bytes.
The region is cut into the same shares here: every rank digests each share, its own from the bytes its slot now
holds (what is restored), the others' from the state it trains on, read before that state next changes (the
snapshot's fence waits for it). A share's fingerprint is the xxh3 of its pieces' xxh3 digests (a piece: the part
of one leaf inside the share), so that on a mismatch the pieces that differ name the tensors. For every share,
the ranks whose fingerprint is not the majority's are the suspects; with two replicas neither can be told.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..snapshot.checksum import checksum
from ..snapshot.layout import share_bounds
from ..snapshot.pack import source_bytes

NAMED = 4  # tensors a mismatch names, per share


def due(step: int, interval: int, every: int) -> bool:
    """Whether the snapshot of `step` is one whose replicas are compared (every `every`-th; 0: none)."""
    return every > 0 and (step // interval) % every == 0


@dataclass(frozen=True)
class Piece:
    leaf: int
    lo: int  # bytes [lo, hi) of the leaf
    hi: int
    at: int  # where they start in the share


def shares(entries: list[dict], replicated: dict) -> list[list[Piece]]:
    """The pieces of each data-parallel rank's share of the replicated region, in region order (a plan's manifest:
    its leaf `entries` and its `replicated` record)."""
    total, dp_size = replicated["total"], replicated["dp_size"]
    leaves = sorted((e["ro"], e["n"], i) for i, e in enumerate(entries) if "ro" in e and e["n"])
    out = []
    for dp_rank in range(dp_size):
        lo, hi, _ = share_bounds(total, dp_rank, dp_size)
        out.append([Piece(i, max(lo, a) - a, min(hi, a + n) - a, max(lo, a) - lo)
                    for a, n, i in leaves if max(lo, a) < min(hi, a + n)])
    return out


def of_state(values: list, pieces: list[Piece]) -> np.ndarray:
    """The digests of `pieces` as the state's tensors (`values`) hold them now; a device tensor's piece is copied
    to the host to be digested."""
    with torch.no_grad():  # the leaves are the caller's parameters too
        return np.array([checksum(source_bytes(values[p.leaf], p.lo, p.hi).cpu().numpy()) for p in pieces],
                        dtype=np.uint64)


def of_slot(data, pieces: list[Piece]) -> np.ndarray:
    """The digests of `pieces` as a slot's stored share (`data`: a buffer starting at the share) holds them."""
    view = memoryview(data)
    return np.array([checksum(view[p.at: p.at + p.hi - p.lo]) for p in pieces], dtype=np.uint64)


def fingerprint(digests: np.ndarray) -> int:
    """One share's fingerprint, as a signed 64-bit integer (what a gloo all_gather of int64 carries)."""
    value = checksum(digests.tobytes())
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class Disagreement:
    share: int
    """The data-parallel rank whose share the replicas hold differently."""
    groups: list[list[int]]
    """The DP ranks grouped by the fingerprint they computed, largest group first."""
    suspects: list[int]
    """The DP ranks outside a strict majority; empty when there is none (two replicas, or a tie)."""


def compare(rows: list[list[int]]) -> list[Disagreement]:
    """`rows[r][j]`: DP rank r's fingerprint of share j. The shares the replicas disagree on."""
    out = []
    for j in range(len(rows)):
        seen = Counter(row[j] for row in rows)
        if len(seen) == 1:
            continue
        groups = sorted(([r for r, row in enumerate(rows) if row[j] == fp] for fp in seen), key=lambda g: (-len(g), g))
        suspects = sorted(r for g in groups[1:] for r in g) if 2 * len(groups[0]) > len(rows) else []
        out.append(Disagreement(j, groups, suspects))
    return out


def differing(pieces: list[Piece], digests: list[np.ndarray]) -> list[int]:
    """The leaves of `pieces` whose digests (one array per DP rank) are not all the same, at most NAMED."""
    stacked = np.stack(digests)
    differ = np.nonzero((stacked != stacked[0]).any(axis=0))[0]
    return [pieces[k].leaf for k in differ[:NAMED]]
