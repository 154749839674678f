"""A snapshot's layout, reused while the state keeps its structure (the usual case: the same tensors with
new values), so that the training thread pays for the walk and the copy and nothing else per tensor.

Planning reads every tensor's dtype and shape and JSON-encodes a manifest with an entry per tensor: about
25 us a tensor, seconds at 10^5 tensors. The training thread's check before reusing a plan is O(1): the
same number of leaves under the same replicated markers. That is enough to *try* the plan, not to trust
it: a tensor whose size or device changed makes the batched copy raise (the snapshot is then planned
afresh on the spot), and before anything is committed the commit thread compares every leaf's dtype, shape
and device kind with the plan (a large tensor is copied alone, so a move between host and device does not
make a batch raise, but its entry says where a restore puts it back); on a mismatch the snapshot is not
committed and the next one is planned afresh.

The manifest is encoded on the commit thread, mostly from bytes encoded once per plan: the leaf entries,
whose checksums are written into their fixed-width places. Its room in the slot is reserved with some
slack (blanks after the JSON), since the scalars in the tree (the step, a loss) may grow between
snapshots.
"""
from __future__ import annotations

import json
import secrets
from operator import attrgetter

from .. import device
from ..errors import InmemFTError
from ..snapshot import layout, segment as seg
from ..snapshot.checksum import checksum, to_hex
from ..snapshot.topology import Topology
from ..snapshot.tree import FlatState
from . import sentinel

MANIFEST_SLACK = 4 << 10
# The losses a snapshot records (capture/sentinel.py) change every snapshot: room for the longest float reprs.
_LOSSES_ROOM = len(',"losses":[]') + sentinel.HISTORY * len("-1.2345678901234567e-308,")
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")


class StalePlan(InmemFTError):
    """The state's tensors no longer match the reused layout: this snapshot is not committed."""


def reserve(manifest_len: int) -> int:
    """The manifest room a slot gets for manifests of about `manifest_len` bytes (whole pages)."""
    return seg.align(manifest_len + max(MANIFEST_SLACK, manifest_len // 8), seg.PAGE)


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


class PlanCache:
    def __init__(self, *, rank: int, world_size: int, dp_rank: int, dp_size: int):
        self._where = dict(rank=rank, world_size=world_size, dp_rank=dp_rank, dp_size=dp_size)
        self._default_topology = Topology.plain(world_size, dp_size, dp_rank)
        self._nonce = secrets.token_hex(8)  # no string in a state can be mistaken for a marker of _head
        self.drop()

    def drop(self) -> None:
        self._plan: layout.Plan | None = None
        self._key: tuple | None = None
        self._dtypes: list = []
        self._shapes: list = []
        self._kinds: list = []
        self._specs: dict = {}  # leaf -> its shard specs, as in the encoded entries
        self._entries = b""  # the manifest's "leaves" list, checksums as placeholders
        self._hashes: list[tuple[int, int, int]] = []  # (place in _entries, data offset, bytes) per own leaf
        self._keyed: dict[int, tuple[list, bytes]] = {}  # first leaf -> a bulk dict's keys and its JSON
        self.manifest_len = 0
        """Bytes of manifest room the plan's slots reserve (padded with blanks, which JSON ignores)."""

    def plan(self, flat: FlatState, step: int, topology: Topology | None) -> tuple[layout.Plan, bool]:
        """(the plan to copy with, whether it is the reused one)."""
        if self._plan is not None and self._key == (len(flat.values), tuple(flat.replicated)):
            return self._plan, True
        return self.fresh(flat, step, topology), False

    def fresh(self, flat: FlatState, step: int, topology: Topology | None) -> layout.Plan:
        """A plan made for `flat`, remembered for the snapshots after it."""
        plan = layout.plan(flat, step=step, topology=topology or self._default_topology, **self._where)
        self._plan, self._key = plan, (len(flat.values), tuple(flat.replicated))
        self._dtypes, self._shapes = list(map(_DTYPE, flat.values)), list(map(_SHAPE, flat.values))
        self._kinds = list(map(device.kind, flat.values))
        self._encode_entries(plan.manifest["leaves"], flat.shards)
        self.manifest_len = reserve(len(self._head(plan.manifest, flat, step, topology)) + len(self._entries) + 12 +
                                    _LOSSES_ROOM)
        return plan

    def _encode_entries(self, entries: list[dict], shards: dict) -> None:
        parts, hashes, end = [], [], 1  # after the "["
        for e in entries:
            if "o" in e:  # an own leaf: its checksum goes last, 16 hex digits ending 2 bytes before the entry
                e = {**{k: v for k, v in e.items() if k != "h"}, "h": e["h"]}
            part = _json(e)
            parts.append(part)
            end += len(part)
            if "o" in e:
                hashes.append((end - 18, e["o"], e["n"]))
            end += 1  # the ","
        self._entries = b"[" + b",".join(parts) + b"]"
        self._hashes = hashes
        self._specs = dict(shards)

    def _head(self, template: dict, flat: FlatState, step: int, topology: Topology | None,
              replicated: dict | None = None, losses: list[float] | None = None) -> bytes:
        """The manifest without its leaf entries. The tree's bulk dicts (10^5 keys of a state dict) are encoded
        once for as long as their keys stay the same: encoded with a marker in their place, then swapped in."""
        head = {k: v for k, v in template.items() if k != "leaves"}
        head.update(step=step, topology=(topology or self._default_topology).to_json(), tree=flat.skeleton)
        if replicated is not None:
            head["replicated"] = replicated
        if losses:
            head["losses"] = losses
        swaps = [(container, key, container[key], f"\0{self._nonce}:{i}\0")
                 for i, (container, key) in enumerate(flat.lazy)]
        for container, key, _, marker in swaps:
            container[key] = marker
        try:
            raw = _json(head)
        finally:
            for container, key, keyed, _ in swaps:
                container[key] = keyed
        for _, _, keyed, marker in swaps:
            raw = raw.replace(_json(marker), self._spelled(keyed), 1)
        return raw

    def _spelled(self, keyed) -> bytes:
        cached = self._keyed.get(keyed.start)
        if cached is None or cached[0] != keyed.keys:
            cached = self._keyed[keyed.start] = (keyed.keys, _json(keyed.spelled()))
        return cached[1]

    def manifest(self, flat: FlatState, step: int, topology: Topology | None, data, *, confirm: bool,
                 losses: list[float]) -> bytes:
        """Commit thread: this snapshot's manifest (JSON), the checksums of `data` (the slot's data bytes, as
        the plan laid them out) filled in, and the `losses` it records (capture/sentinel.py). With `confirm` (a reused plan), every leaf is first checked to have
        the plan's dtype and shape: StalePlan (and the plan is forgotten) if one has not."""
        if self._plan is None:
            raise StalePlan(f"step {step}: the reused layout was dropped meanwhile; not committed")
        template = self._plan.manifest
        if confirm:
            self._confirm(flat, step)
            if flat.shards != self._specs:
                entries = [{k: v for k, v in e.items() if k != "shards"} for e in template["leaves"]]
                for i, specs in flat.shards.items():
                    entries[i]["shards"] = [s.to_json() for s in specs]
                self._encode_entries(entries, flat.shards)
        out = bytearray(self._entries)
        for place, off, n in self._hashes:
            out[place: place + 16] = to_hex(checksum(data[off: off + n])).encode()
        replicated = template["replicated"]
        if replicated:
            replicated = {**replicated, "h": to_hex(checksum(data[replicated["o"]: replicated["o"] + replicated["hi"]
                                                                 - replicated["lo"]]))}
        head = self._head(template, flat, step, topology, replicated, losses)
        return head[:-1] + b',"leaves":' + out + b"}"

    def _confirm(self, flat: FlatState, step: int) -> None:
        dtypes, shapes = list(map(_DTYPE, flat.values)), list(map(_SHAPE, flat.values))
        kinds = list(map(device.kind, flat.values))
        if dtypes == self._dtypes and shapes == self._shapes and kinds == self._kinds:
            return
        now, was = list(zip(dtypes, shapes, kinds)), list(zip(self._dtypes, self._shapes, self._kinds))
        i = next(i for i, (a, b) in enumerate(zip(now, was)) if a != b)
        self.drop()
        raise StalePlan(f"step {step}: {flat.path_of(i)} changed from {_described(was[i])} to {_described(now[i])} "
                        f"under an unchanged structure; this snapshot is not committed, the next one is laid out "
                        f"afresh")


def _described(leaf: tuple) -> str:
    dtype, shape, kind = leaf
    return f"{dtype}{list(shape)}" + (f" on {kind}" if kind else " on the host")
