"""Replica fingerprints: every K-th snapshot, the data-parallel replicas compare what they hold of the replicated
region, so that a rank whose copy of the weights silently changed (a bit flipped by a bad GPU or host) is caught
before its snapshot is trusted.

Each replica stores only its share of the region (snapshot/layout.py), so no two snapshots hold the same bytes.
The region is cut into the same shares here: every rank digests each share, its own from the bytes its slot now
holds (what is restored), the others' from the state it trains on, read before that state next changes (the
snapshot's fence waits for it). A share's fingerprint is the xxh3 of its pieces' digests (a piece: the part of one
leaf inside the share), so that on a mismatch the pieces that differ name the tensors. For every share, the ranks
whose fingerprint is not the majority's are the suspects; with two replicas neither can be told.

A piece's digest is computed where its tensor lives, and every replica computes it the same way (the replicas'
tensors live alike), so the digests compare:
- on the host, xxh3 of its bytes (memory speed; the own share's from the slot);
- in accelerator memory, with torch ops there, without a host copy: each CHUNK of its bytes summed with
  position-dependent multipliers (exact integer sums, so any changed byte changes its chunk's sum), only those
  sums (8 bytes per 64 KiB) brought to the host and hashed there. The own share's device pieces are digested
  from the state too, beside the others (the slot is host memory, where these ops run at ~0.1 GB/s, against
  xxh3's ~15 GB/s); the slot's copy of them is covered by its checksums as every snapshot's is.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from .. import device
from ..snapshot.checksum import checksum
from ..snapshot.layout import share_bounds
from ..snapshot.pack import source_bytes

NAMED = 4  # tensors a mismatch names, per share
CHUNK = 1 << 16  # bytes per position-weighted sum of a device piece
_BATCH = 256  # chunks summed per kernel: bounds the int32 temporary at 64 MiB
_SEED = 0x40F1  # the multipliers are the same on every rank and device
_weights: dict = {}  # torch.device -> its copy of the multipliers


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


def of_state(values: list, pieces: list[Piece], *, device_only: bool = False) -> np.ndarray:
    """The digests of `pieces` as the state's tensors (`values`) hold them now, each where its tensor lives (see the
    module docstring); with `device_only`, host pieces are left 0 (of_slot digests them from the stored share)."""
    out = np.zeros(len(pieces), dtype=np.uint64)
    sums, where = [], []
    with torch.no_grad():  # the leaves are the caller's parameters too
        for k, p in enumerate(pieces):
            value = values[p.leaf]
            if device.accelerated(value):
                sums.append(chunk_sums(source_bytes(value, p.lo, p.hi)))
                where.append(k)
            elif not device_only:
                out[k] = checksum(source_bytes(value, p.lo, p.hi).cpu().numpy())  # host: .cpu() is itself
        for k, host in zip(where, _to_host(sums)):
            out[k] = checksum(host)
    return out


def of_slot(data, pieces: list[Piece], values: list, digests: np.ndarray) -> np.ndarray:
    """`digests` (of_state's of the same pieces, `device_only`) with the host pieces digested as a slot's stored share
    (`data`: a buffer starting at the share) holds them."""
    view, out = memoryview(data), digests.copy()
    for k, p in enumerate(pieces):
        if not device.accelerated(values[p.leaf]):
            out[k] = checksum(view[p.at: p.at + p.hi - p.lo])
    return out


def chunk_sums(data: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor's digest where it lives, as int64 sums: sum(byte[i] * w[i]) over each CHUNK bytes, the last
    chunk shorter. The multipliers are odd and below 2**23, so a product fits int32 and a chunk's sum int64
    exactly: a changed byte changes its chunk's sum, and which bytes are where matters."""
    w = weights(data.device)
    n = data.numel()
    full = n // CHUNK
    out = [data[s * CHUNK: min(full, s + _BATCH) * CHUNK].view(-1, CHUNK).to(torch.int32).mul_(w).sum(dim=1)
           for s in range(0, full, _BATCH)]
    if n % CHUNK:
        out.append((data[full * CHUNK:].to(torch.int32) * w[: n % CHUNK]).sum().reshape(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=data.device)


def weights(where: torch.device) -> torch.Tensor:
    """chunk_sums' CHUNK multipliers on device `where`: made on the host from a fixed seed, the same everywhere."""
    w = _weights.get(where)
    if w is None:
        g = torch.Generator().manual_seed(_SEED)
        w = _weights[where] = (torch.randint(0, 1 << 22, (CHUNK,), generator=g, dtype=torch.int32) * 2 + 1).to(where)
    return w


def _to_host(sums: list[torch.Tensor]) -> list[np.ndarray]:
    """Each piece's chunk sums on the host: one transfer (and one wait) per device, not per piece."""
    out: list = [None] * len(sums)
    by_device: dict = {}
    for k, t in enumerate(sums):
        by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        host = torch.cat([sums[k] for k in ks]).cpu().numpy()
        at = 0
        for k in ks:
            out[k], at = host[at: at + sums[k].numel()], at + sums[k].numel()
    return out


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
