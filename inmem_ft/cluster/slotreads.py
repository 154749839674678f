"""Reads of any committed slot of the job from any node: listings, verified byte ranges, and pulls.

Peer operations, for any SMP of the job (authenticated with the job secret):
    slots      {step?, rank?}                    this node's committed slots; their manifests follow as payload
    slot_read  {rank, step, off, len}            bytes [off, off+len) of one of them (slot offsets)
    lost_slots {lost, step?, rank?}              the listing of `lost`, a lost member of this node's EC group,
    lost_read  {lost, rank, step, off, len}      and its bytes, decoded from parity (a sub-range of a lost
                                                 chunk decodes from the same sub-range of k survivors)
Control operations, for trainers and the CLI on this node (the secret never leaves the SMP): `catalog`,
`read` and `pull` (see SlotReads.op_*).

Every byte served was checked against the slot's region checksums: each region is verified once per slot
(streamed in pieces, so a parity-decoded region costs no more memory than a read), and a memory read
copies out and then rechecks the header, so a slot reused by a newer snapshot mid-read fails instead of
returning mixed bytes. No request may ask for more than READ_MAX bytes.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost
from ..smp import fields
from ..smp.protocol import MAX_PAYLOAD, READ_MAX
from ..snapshot import segment as seg
from . import nodedata
from .transport import PeerUnavailable

log = logging.getLogger("inmem_ft.reads")
_VIEWS = 64  # verified slots remembered (their manifests and which regions passed)
_FAN_OUT = 16  # nodes asked at once for a catalog


class SlotView:
    """One committed slot as a reader sees it: header, manifest, and verified reads of its bytes."""

    def __init__(self, where: str, header: seg.Header, manifest: dict, read):
        """`read(off, n) -> n bytes` of the slot, unverified; `where` names node, rank and step for errors."""
        self.where, self.header, self.manifest, self._read = where, header, manifest, read
        self.size = header.data_off + header.data_len
        self._regions = seg.regions(manifest, header.data_off)
        self._ok: set[int] = set()
        self._lock = threading.Lock()
        self.raw_manifest: bytes | None = None  # as stored, for listings that forward it

    def read(self, off: int, n: int) -> np.ndarray:
        if off < 0 or n < 0 or off + n > self.size:
            raise InmemFTError(f"{self.where}: bytes [{off}, {off + n}) leave the slot's {self.size} bytes")
        if n > READ_MAX:
            raise InmemFTError(f"{self.where}: a read asks for {n} bytes, at most {READ_MAX} per request")
        with self._lock:
            for i, (lo, hi, expected, _) in enumerate(self._regions):
                if lo < off + n and off < hi and i not in self._ok:
                    self._verify(lo, hi, expected)
                    self._ok.add(i)
        return self._read(off, n)

    def _verify(self, lo: int, hi: int, expected: int) -> None:
        digest = xxhash.xxh3_64()
        for a in range(lo, hi, READ_MAX):
            digest.update(self._read(a, min(READ_MAX, hi - a)))
        if digest.intdigest() != expected:
            raise SnapshotCorrupt(f"{self.where}: slot bytes [{lo}, {hi}) fail their checksum: the snapshot is "
                                  f"corrupted there and is not served; use another step or tier")


class SlotReads:
    OPS = ("catalog", "read", "pull")

    def __init__(self, smp, peers, protector=None):
        self.smp, self.node, self.peers, self.protector = smp, smp.node, peers, protector
        self._views: OrderedDict = OrderedDict()
        self._views_lock = threading.Lock()
        peers.register("slots", self._peer_slots)
        peers.register("slot_read", self._peer_read)
        if protector is not None:
            peers.register("lost_slots", self._peer_lost_slots, protector.partners)
            peers.register("lost_read", self._peer_lost_read, protector.partners)

    def handle(self, op: str, msg: dict) -> tuple[dict, list]:
        return getattr(self, f"op_{op}")(msg)

    # ---- control operations ---------------------------------------------------------------------------
    def op_catalog(self, msg):
        """Every node's committed slots (of `step`, default all): {"entries": [...], "unreachable": [{node,
        error}]}, the entries' manifests concatenated after the reply. Each SMP answers for its own slots; a
        lost node's come from parity (source "parity")."""
        step = fields.step(msg, optional=True)
        entries, manifests, unreachable = [], [], []
        with ThreadPoolExecutor(min(_FAN_OUT, len(self.peers.nodes)), thread_name_prefix="inmem_ft-catalog") as pool:
            asked = {node: pool.submit(self._listing, node, step=step) for node in self.peers.nodes}
        for node, future in asked.items():
            try:
                listed, raw = future.result()
            except (PeerUnavailable, InmemFTError) as e:
                unreachable.append({"node": node, "error": str(e)})
                continue
            entries += listed
            manifests.append(raw)
        _check_payload(sum(len(m) for m in manifests), "the catalog's manifests")
        return {"entries": entries, "unreachable": unreachable}, manifests

    def op_read(self, msg):
        """Bytes [offset, offset+length) of node `node`'s committed slot of `rank` at `step`, at most READ_MAX;
        {"source": "memory" | "parity"} and the bytes after it."""
        node, rank, step = fields.integer(msg, "node", fields.MAX_NODE), fields.rank(msg), fields.step(msg)
        off, n = fields.size(msg, "offset"), fields.integer(msg, "length", READ_MAX)
        data, source = self._read(node, rank, step, off, np.empty(n, dtype=np.uint8))
        return {"source": source}, [data]

    def op_pull(self, msg):
        """Copy `rank`'s newest committed slots (two steps at most) from other nodes, or decode them from parity,
        into local slots, unless this node holds that step already: {"slots": [{segment, step, source,
        from_node}]}, newest first; a trainer then restores from local shared memory as usual."""
        rank = fields.rank(msg)
        best: dict[int, dict] = {}
        for node in self.peers.nodes:
            if node == self.node:
                continue
            try:
                listed, _ = self._listing(node, rank=rank)
            except (PeerUnavailable, InmemFTError) as e:
                log.warning("smp node=%d event=pull_skip rank=%d node=%d reason=%s", self.node, rank, node, e)
                continue
            for entry in listed:
                if entry["step"] not in best or best[entry["step"]]["source"] == "parity":
                    best[entry["step"]] = entry
        local = {slot.committed_step() for _, slot in self.smp.committed(rank)}
        out = []
        for step in sorted(best, reverse=True)[:2]:
            if step in local:
                continue
            entry = best[step]
            slot = self.smp.install(rank, seg.slot_size(entry["manifest_len"], entry["data_len"]),
                                    lambda buf, e=entry: self._copy_slot(e, buf),
                                    "peer_memory" if entry["source"] == "memory" else "peer_reconstruction")
            log.info("smp node=%d event=pulled rank=%d step=%d from_node=%d source=%s", self.node, rank, step,
                     entry["node"], entry["source"])
            out.append({"segment": slot.segment.name, "step": step, "source": slot.source,
                        "from_node": entry["node"]})
        return {"slots": out}, []

    def _copy_slot(self, entry: dict, buf) -> None:
        dst = np.frombuffer(buf, dtype=np.uint8)
        used = entry["data_off"] + entry["data_len"]
        for a in range(0, used, READ_MAX):
            n = min(READ_MAX, used - a)
            self._read(entry["node"], entry["rank"], entry["step"], a, dst[a: a + n])

    # ---- asking a node, or its EC group when it is lost ----------------------------------------------------
    def _listing(self, node: int, step: int | None = None, rank: int | None = None) -> tuple[list, bytes]:
        header = {"op": "slots", "step": step, "rank": rank}
        try:
            reply, raw = self.peers.call(node, header)
        except PeerUnavailable as e:
            # Once per listing, not per read: a catalog or pull lists before it reads.
            log.warning("smp node=%d event=via_parity node=%d reason=%s", self.node, node, e)
            reply, raw = self._via_parity(node, {**header, "op": "lost_slots", "lost": node}, e)
        return reply["entries"], raw.tobytes()

    def _read(self, node: int, rank: int, step: int, off: int, into: np.ndarray) -> tuple[np.ndarray, str]:
        header = {"op": "slot_read", "rank": rank, "step": step, "off": off, "len": into.nbytes}
        try:
            return self.peers.call(node, header, into=into)[1], "memory"
        except PeerUnavailable as e:
            return self._via_parity(node, {**header, "op": "lost_read", "lost": node}, e, into)[1], "parity"

    def _via_parity(self, lost: int, header: dict, why: Exception, into=None):
        if self.protector is None:
            raise PeerUnavailable(f"node {lost} is unreachable ({why}) and this SMP runs without parity, so its "
                                  f"snapshots cannot be decoded; start the SMPs with --parity to survive node loss")
        # The groups `lost` was in, the newest first: a step the job shrank from is protected by the old ones.
        groups, m = self.protector.groups_with(lost) or [[lost]], self.protector.m
        errors: dict[int, Exception] = {lost: why}
        for member in dict.fromkeys(n for members in groups for n in members):
            if member == lost:
                continue
            try:
                return self.peers.call(member, header, into=into)
            except InmemFTError as e:  # PeerUnavailable included
                errors[member] = e
        unreachable = [n for n, e in errors.items() if isinstance(e, PeerUnavailable)]
        members = next((g for g in groups if set(unreachable) <= set(g)), groups[-1])
        if len(unreachable) > m:
            # This alone explains the loss: what the members that did answer said follows from it.
            what = (f"nodes {sorted(unreachable)} of EC group {members} are unreachable, more than its parity "
                    f"m={m} tolerates")
            errors = {n: errors[n] for n in unreachable}
        else:  # a member holding parity answered but could not decode: its error says why
            what = (f"node {lost} is unreachable and no member of EC group {members} could decode its snapshots "
                    f"from parity")
        raise SnapshotLost(f"{what}; restore the job from the next tier (disk) "
                           f"({'; '.join(f'node {n}: {e}' for n, e in sorted(errors.items()))})")

    # ---- peer operations -------------------------------------------------------------------------------
    def _peer_slots(self, peer, header, payload):
        entries, manifests = [], []
        for rank, slot in self.smp.committed(_opt_int(header.get("rank")), _opt_int(header.get("step"))):
            buf = slot.segment.buf
            try:
                h, _ = seg.read_committed(buf, f"node {self.node} rank {rank} slot {slot.segment.name}")
            except InmemFTError as e:  # overwritten since committed() looked, or corrupt: not listed
                log.warning("smp node=%d event=unlisted rank=%d reason=%s", self.node, rank, e)
                continue
            manifests.append(bytes(seg.manifest_view(buf, h)))
            entries.append(_entry(self.node, rank, h, slot.segment.name, "memory"))
        return {"entries": entries}, manifests

    def _peer_read(self, peer, header, payload):
        rank, step = int(header["rank"]), int(header["step"])
        found = self.smp.committed(rank, step)
        if not found:
            raise InmemFTError(f"node {self.node} holds no committed slot of rank {rank} at step {step} (it was "
                               f"overwritten by a newer snapshot, or the rank runs elsewhere): list the slots again")
        view = self._memory_view(rank, found[0][1])
        return {}, [view.read(int(header["off"]), int(header["len"]))]

    def _peer_lost_slots(self, peer, header, payload):
        lost = int(header["lost"])
        rank, step = _opt_int(header.get("rank")), _opt_int(header.get("step"))
        entries, manifests = [], []
        for s in self.protector.parity_steps() if step is None else [step]:
            if step is None and not self.protector.holds_parity_of(lost, s):
                continue  # parity of another group's step (formed over other nodes)
            for r, view in sorted(self._lost_views(lost, s).items()):
                if rank is None or r == rank:
                    manifests.append(view.raw_manifest)
                    entries.append(_entry(lost, r, view.header, None, "parity"))
        return {"entries": entries}, manifests

    def _peer_lost_read(self, peer, header, payload):
        lost, rank, step = int(header["lost"]), int(header["rank"]), int(header["step"])
        view = self._lost_views(lost, step).get(rank)
        if view is None:
            raise InmemFTError(f"node {lost}'s parity-protected data of step {step} holds no slot of rank {rank}")
        return {}, [view.read(int(header["off"]), int(header["len"]))]

    # ---- slot views --------------------------------------------------------------------------------------
    def _cached(self, key, make):
        with self._views_lock:
            if key in self._views:
                self._views.move_to_end(key)
                return self._views[key]
        value = make()
        with self._views_lock:
            self._views[key] = value
            while len(self._views) > _VIEWS:
                self._views.popitem(last=False)
        return value

    def _memory_view(self, rank: int, slot) -> SlotView:
        buf = slot.segment.buf
        where = f"node {self.node} rank {rank} slot {slot.segment.name}"
        header, manifest = seg.read_committed(buf, where)
        where = f"node {self.node} rank {rank} step {header.step}"

        def read(off, n):
            out = np.frombuffer(buf, dtype=np.uint8, count=n, offset=off).copy()
            if seg.Header.read(buf) != header:
                raise InmemFTError(f"{where}: the slot was reused by a newer snapshot during the read; list the "
                                   f"slots again and read a step the job still holds")
            return out
        return self._cached(("memory", slot.segment.name, header.step, header.manifest_hash),
                            lambda: SlotView(where, header, manifest, read))

    def _lost_views(self, lost: int, step: int) -> dict[int, SlotView]:
        """rank -> view of each slot in lost member `lost`'s node data at `step`, decoded from parity."""
        members = self.protector.group_of(step).members  # SnapshotLost where this node holds no parity of it
        if lost == self.node or lost not in members:
            raise InmemFTError(f"node {self.node} cannot decode node {lost}: not another member of EC group "
                               f"{members}, which protects step {step}")

        def decode(off, n):
            return self.protector.decode_range(lost, step, off, n)

        def make():
            length = self.protector.lost_length(lost, step)

            def read(off, n):
                if off < 0 or off + n > length:
                    raise ValueError(f"node {lost}'s data at step {step} has {length} bytes, asked [{off}, {off + n})")
                return decode(off, n)
            got, ranks = nodedata.read_index(read)
            if got != step:
                raise SnapshotCorrupt(f"node {lost}'s data decoded from parity names step {got}, expected {step}")
            views = {}
            for rank, (start, size) in ranks.items():
                where = f"node {lost} rank {rank} step {step} (decoded from parity)"
                first = seg.Header.read(read(start, seg.HEADER_SIZE))
                if first is None:
                    raise SnapshotCorrupt(f"{where}: the decoded slot header fails its checksum")
                head = read(start, first.data_off)
                header, manifest = seg.read_committed(head, where, size=size)
                views[rank] = SlotView(where, header, manifest, lambda off, n, s=start: read(s + off, n))
                views[rank].raw_manifest = bytes(seg.manifest_view(head, header))
            return views
        return self._cached(("parity", lost, step), make)


def _entry(node: int, rank: int, header: seg.Header, segment: str | None, source: str) -> dict:
    """A listed slot: where its bytes are; its manifest travels beside it (`manifest_len` bytes)."""
    return {"node": node, "rank": rank, "step": header.step, "segment": segment, "data_off": header.data_off,
            "data_len": header.data_len, "manifest_len": header.manifest_len, "source": source}


def _opt_int(value) -> int | None:
    return None if value is None else int(value)


def _check_payload(n: int, what: str) -> None:
    if n > MAX_PAYLOAD:
        raise InmemFTError(f"{what} take {n} bytes, over the {MAX_PAYLOAD}-byte limit of one reply: ask for one "
                           f"step at a time")
