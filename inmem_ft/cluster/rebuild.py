"""Rebuilding a lost node's slots and parity from its EC group, streamed in bounded pieces.

A replacement SMP (same node index, empty memory) decodes its node data (cluster/nodedata.py) and its parity
chunks one piece of at most `piece` bytes at a time: it pulls the same byte range of k surviving blocks of the
stripe (data through node_read, parity through chunk), decodes the block it lost and writes it straight into
its own segments, created at their final size first (the sizes come from the node-data index and the slot
headers, decoded first). Memory: its own segments plus k + m piece buffers, whatever the node size; no peer
message carries more than one piece, so a node of any size stays under the transport's payload cap.

Never half: each slot's header (its first 4096 bytes) is held aside and written once every other byte is in
place, then the slot is verified, so until the end a slot is blank and the parity set `building`: nothing
half-built is served or adopted as a snapshot. A record beside the segments (`<prefix>rebuild`) says how far
the rebuild got (rewritten every RECORD_EVERY_S). An SMP killed mid-rebuild and restarted keeps those blank
slots and that parity set, and resumes from the record when the group still holds the same step with the same
layout and every segment is still there at its size (event=rebuild_resume from=BYTES); otherwise it drops
them and starts over (event=rebuild_restart). Either way every slot is verified before it is installed, and
`event=rebuilt` is logged only when every slot verified and the parity is sealed.

Bad survivors: one that is unreachable, refuses (its parity chunk fails its checksum) or sends bytes failing
their MAC is skipped for the rest of the rebuild and another block of the stripe is used (event=skip_source).
Flipped bits in a survivor's slot memory (node reads do not checksum every piece) show up as a rebuilt slot
failing its checksums: the rebuild then runs again without each survivor in turn (event=rebuild_retry) and
names the one whose absence verified (event=rebuild_corrupt). Giving up names the nodes and why.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from .. import events
from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost
from ..smp import paths
from ..smp.segments import read_record, unlink, write_record
from ..snapshot import segment as seg
from . import nodedata
from .paritystore import BUILDING, PROTECTED, ParitySet
from .transport import PeerUnavailable

log = logging.getLogger("inmem_ft.ec")
PIECE = 8 << 20  # default bytes per pull: amortises a round trip, bounds memory to k + m of them
PROGRESS_EVERY_S = 5.0  # how often an operator sees event=rebuild_progress
RECORD_EVERY_S = 0.5  # how often the record says how far the rebuild got (what a restart resumes from)


class StripeReader:
    """Byte ranges of one block of a stripe at `step`, decoded from the same range of k other blocks; a source
    that fails is skipped (for good: `bad`) and the next block of the stripe is asked instead."""

    def __init__(self, protector, step: int, chunk_size: int, lost, pool: ThreadPoolExecutor | None = None,
                 lost_as: str = "lost", group=None):
        """`group`: the protection.Group `step`'s parity was encoded by (default: the protector's own now)."""
        self.node, self.peers, self.step, self.cs = protector.node, protector.peers, step, chunk_size
        self.members, self.layout = (group.members, group.layout) if group else (protector.members, protector.layout)
        self.lost = set(lost)  # nodes never asked
        self.lost_as = lost_as  # what those nodes are, for errors: lost (a rebuild) or unreachable (a read)
        self.bad: dict[int, InmemFTError] = {}  # node -> why it was skipped
        self.pool = pool  # pulls of one piece run side by side when given
        self._bufs: dict[int, np.ndarray] = {}  # block -> its piece buffer, reused piece after piece

    def sources(self, stripe: int, a: int, n: int) -> list[tuple[int, int, dict]]:
        """(block, node, request) for bytes [a, a+n) of every block of `stripe`, data blocks first."""
        s = self.layout.stripes[stripe]
        out = [(i, self.members[p], {"op": "node_read", "step": self.step, "off": c * self.cs + a, "len": n})
               for i, (p, c) in enumerate(s.data)]
        return out + [(self.layout.k + j, self.members[p], {"op": "chunk", "step": self.step, "stripe": stripe,
                                                            "off": a, "len": n}) for j, p in enumerate(s.parity_nodes)]

    def decode(self, stripe: int, want: int, a: int, out: np.ndarray, exclude=()) -> None:
        """Bytes [a, a+len(out)) of block `want` of `stripe`, into `out`; `exclude`: nodes not to ask."""
        n, k = out.nbytes, self.layout.k
        candidates = iter([src for src in self.sources(stripe, a, n)
                           if src[0] != want and src[1] not in self.lost and src[1] not in exclude])
        blocks: dict[int, np.ndarray] = {}
        while len(blocks) < k:
            batch = []
            for src in candidates:
                if src[1] not in self.bad:
                    batch.append(src)
                    if len(batch) == k - len(blocks):
                        break
            if not batch:
                raise SnapshotLost(self._too_few(stripe, exclude))
            if self.pool is None:
                pulls = [(src, None) for src in batch]
            else:
                pulls = [(src, self.pool.submit(self._pull, src, n)) for src in batch]
            for src, future in pulls:
                try:
                    blocks[src[0]] = self._pull(src, n) if future is None else future.result()
                except InmemFTError as e:  # unreachable, refused, or failed its MAC (AuthError)
                    self.bad[src[1]] = e
                    log.warning("ec node=%d event=skip_source source=%d step=%d stripe=%d reason=%s: asking "
                                "another survivor", self.node, src[1], self.step, stripe, e)
        self.layout.codec.decode(blocks, [want], {want: out})

    def node_bytes(self, pos: int, off: int, out: np.ndarray, piece: int, exclude=()) -> None:
        """Bytes [off, off+len(out)) of member `pos`'s node data, decoded across its chunks, at most `piece`
        bytes per pull."""
        at, end = off, off + out.nbytes
        while at < end:
            c, a = divmod(at, self.cs)
            n = min(end - at, self.cs - a, piece)
            self.decode(self.layout.data_stripe(pos, c), c, a, out[at - off: at - off + n], exclude)
            at += n

    def _pull(self, src, n: int) -> np.ndarray:
        block, node, header = src
        buf = self._bufs.get(block)
        if buf is None or buf.nbytes < n:
            buf = self._bufs[block] = np.empty(n, dtype=np.uint8)
        return self.peers.call(node, header, into=buf[:n])[1]

    def _too_few(self, stripe: int, exclude) -> str:
        # The nodes first (always more than m: the block wanted is on one of them), then what to do, then why
        # each was skipped: the user acts on the first line of it.
        state = {n: self.lost_as for n in self.lost} | {n: "left out" for n in exclude}
        state |= {n: "unreachable" if isinstance(e, PeerUnavailable) else "failing" for n, e in self.bad.items()}
        why = "; ".join(f"node {n}: {e}" for n, e in sorted(self.bad.items()))
        return (f"nodes {sorted(state)} of EC group {self.members} are {' or '.join(sorted(set(state.values())))}, "
                f"more than its parity m={self.layout.m} tolerates: stripe {stripe} of step {self.step} cannot be "
                f"decoded; restore the job from the next tier (disk){f' ({why})' if why else ''}")


class VerifyFailed(SnapshotCorrupt):
    """Bytes decoded from the survivors do not verify: one of them served corrupt data."""


class Rebuild:
    """One rebuild of node `protector.node`'s data and parity at `step` (its group's parity `record`); `was`:
    the record of a rebuild of this node that its previous SMP did not finish (it resumes where that one got
    when it rebuilt the same step from the same group), or None."""

    def __init__(self, protector, step: int, record: dict, lost: list[int], piece: int, was: dict | None = None):
        self.p, self.smp, self.step, self.record = protector, protector.smp, step, record
        self.layout, self.pos, self.piece = protector.layout, protector.pos, piece
        self.cs = self.layout.chunk_size(record["padded"])
        self.length = record["lens"][self.pos]
        self.lost = lost
        self.was = was
        same = was is not None and was.get("step") == step and was.get("group") == record_group(record)
        self.resume_at = int(was.get("done", 0)) if same else 0

    def run(self) -> None:
        if self.was is not None and not self.resume_at:
            log.warning("ec node=%d event=rebuild_restart step=%s reason=the SMP stopped during a rebuild that "
                        "cannot be resumed (another step, group or nothing done); dropping what it installed",
                        self.p.node, self.was.get("step"))
            with self.smp.lock:
                self.smp.wipe()
        self._note(self.resume_at)
        try:
            self._run()
        finally:
            # Only a killed SMP leaves the record behind: a failed rebuild already dropped what it installed,
            # and snapshots written after it must not be wiped by the next restart.
            forget(self.smp)

    def _note(self, done: int) -> None:
        write_record(paths.rebuild_record_name(self.smp.job, self.smp.node), json.dumps(
            {"step": self.step, "lost": self.lost, "group": record_group(self.record), "done": done}))

    def _run(self) -> None:
        t0 = time.perf_counter()
        events.emit(events.Source("smp", self.p.node), "ec", "rebuild_resume" if self.resume_at else "rebuild_start",
                    say=log.info, step=self.step, lost=self.lost, bytes=self.length, piece=self.piece,
                    **{"from": self.resume_at})
        survivors = [n for n in self.p.members if n not in self.lost]
        spare = len(survivors) > self.layout.k  # a choice of blocks: one survivor can be left out
        with ThreadPoolExecutor(self.layout.k, thread_name_prefix="inmem_ft-ec-rebuild") as pool:
            reader = StripeReader(self.p, self.step, self.cs, self.lost, pool)
            failures = []
            for exclude in [()] + ([(n,) for n in survivors] if spare else []):
                if exclude and exclude[0] in reader.bad:
                    continue  # already skipped by every attempt
                try:
                    ranks, ps = self._attempt(reader, exclude, 0 if exclude else self.resume_at)
                    break
                except VerifyFailed as e:
                    failures.append(f"{'without node %d' % exclude[0] if exclude else 'all survivors'}: {e}")
                    log.warning("ec node=%d event=rebuild_retry step=%d reason=%s", self.p.node, self.step, e)
            else:
                raise SnapshotCorrupt(f"node {self.p.node}'s data of step {self.step} rebuilt from EC group "
                                      f"{self.p.members} does not verify with any choice of survivors ("
                                      f"{'; '.join(failures)}); restore the job from the next tier (disk)")
        if exclude:
            log.warning("ec node=%d event=rebuild_corrupt source=%d step=%d reason=with node %d's blocks the "
                        "rebuilt slots fail their checksums, without them they verify: its memory is corrupt",
                        self.p.node, exclude[0], self.step, exclude[0])
        with self.smp.lock:
            self.p.sets[self.step], self.p.protected = ps, self.step
        events.emit(events.Source("smp", self.p.node), "ec", "rebuilt", say=log.info, step=self.step,
                    ranks=sorted(ranks), bytes=self.length, seconds=time.perf_counter() - t0)

    def _attempt(self, reader: StripeReader, exclude, done: int) -> tuple[list[int], ParitySet]:
        """Decode, write and verify every slot and the parity once, going on from byte `done` of the stream
        (_fill) when the interrupted rebuild's segments are all still here; on a failure nothing stays."""
        node = self.p.node
        where = f"node {node}'s data of step {self.step} (rebuilt{', without node %d' % exclude[0] if exclude else ''})"

        def read(off, n):  # small reads: the index and the slot headers
            if off < 0 or off + n > self.length:
                raise VerifyFailed(f"{where}: the index points at [{off}, {off + n}), past its {self.length} bytes")
            out = np.empty(n, dtype=np.uint8)
            reader.node_bytes(self.pos, off, out, self.piece, exclude)
            return out
        try:
            got, index = nodedata.read_index(read)
        except (ValueError, KeyError, TypeError) as e:
            raise VerifyFailed(f"{where}: its index is garbage ({e})") from None
        if got != self.step:
            raise VerifyFailed(f"{where}: its index names step {got}")
        slots, ps = {}, None
        try:
            for rank, (start, used) in sorted(index.items()):
                head = read(start, seg.HEADER_SIZE) if used >= seg.HEADER_SIZE else None
                header = seg.Header.read(head) if head is not None else None
                if header is None or header.state != seg.COMMITTED or header.data_off + header.data_len != used:
                    raise VerifyFailed(f"{where}: rank {rank}'s slot header fails its checks")
                size = seg.slot_size(header.manifest_len, header.data_len)
                slot = self._kept_slot(rank, size)
                if slot is None:
                    done = 0  # this slot starts empty: nothing before can be skipped
                    slot = self.smp.reserve_copy(rank, size, "peer_reconstruction", 0)
                slots[rank] = (start, used, head, slot)
            with self.smp.lock:
                ps = self.p.sets.pop(self.step, None)
            if ps is None or ps.state != BUILDING or ps.record["chunk_size"] != self.cs:
                done = 0
                ps = ParitySet.create(self.smp.prefix, self.step, self.layout.m, self.cs,
                                      {**record_group(self.record), "ranks": sorted(index)})
            self._fill(reader, slots, ps, exclude, done)
            for rank, (_, _, head, slot) in slots.items():
                # The header last: until then the slot is blank, never adopted as a snapshot.
                try:
                    self.smp.finish_copy(slot, head, f"node {node} rank {rank} step {self.step} (rebuilt)")
                except SnapshotCorrupt as e:
                    raise VerifyFailed(str(e)) from None
        except BaseException:
            for rank in slots:
                self.smp.drop_slots(rank)
            if ps is not None:
                ps.drop()
            raise
        ps.seal(PROTECTED)
        return sorted(index), ps

    def _kept_slot(self, rank: int, size: int):
        """The blank slot 0 of `rank` that the interrupted rebuild was filling, if it is the size needed."""
        if not self.resume_at:
            return None
        with self.smp.lock:
            slot = self.smp.slots.get(rank, [None])[0]
        return slot if slot is not None and slot.segment.size == size else None

    def _fill(self, reader: StripeReader, slots: dict, ps: ParitySet, exclude, done: int) -> None:
        """Every byte of the node data past the index, then the parity chunks, piece by piece: the stream's
        byte p is byte p of the node data for p < k*cs, else of parity chunk (p - k*cs) // cs. Pieces that end
        by `done` were written before the SMP was killed and are skipped; the record keeps `done` current."""
        total = (self.layout.k + self.layout.m) * self.cs
        parts = [(start + seg.HEADER_SIZE, start + used, slot.segment.buf, start)
                 for start, used, _, slot in slots.values() if used > seg.HEADER_SIZE]
        buf = np.empty(min(self.piece, self.cs), dtype=np.uint8)
        k, said, noted = self.layout.k, time.monotonic(), time.monotonic()
        with tqdm(total=total, initial=done, desc=f"rebuild node {self.p.node} step {self.step}", unit="B",
                  unit_scale=True, file=sys.stderr, mininterval=0.5) as bar:
            for c, a in ((c, a) for c in range(k + self.layout.m) for a in range(0, self.cs, self.piece)):
                pos, n = c * self.cs + a, min(self.piece, self.cs - a)
                if pos + n <= done:
                    continue
                if c < k and any(s < pos + n and e > pos for s, e, _, _ in parts):
                    reader.node_bytes(self.pos, pos, buf[:n], self.piece, exclude)
                    for s, e, dst, base in parts:
                        x, y = max(s, pos), min(e, pos + n)
                        if x < y:
                            dst[x - base: y - base] = buf[x - pos: y - pos]
                elif c >= k:
                    stripe, p = self.layout.parity_for_node(self.pos)[c - k]
                    reader.decode(stripe, k + p, a, ps.chunk(c - k)[a: a + n], exclude)
                bar.update(n)
                now = time.monotonic()
                if now - noted >= RECORD_EVERY_S:
                    self._note(pos + n)
                    noted = now
                if now - said >= PROGRESS_EVERY_S:
                    log.info("ec node=%d event=rebuild_progress step=%d done=%d of=%d", self.p.node, self.step,
                             bar.n, total)
                    said = now


def interrupted(smp) -> dict | None:
    """The record of a rebuild of this node that never finished (its SMP was killed during it), or None."""
    text = read_record(paths.rebuild_record_name(smp.job, smp.node))
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def forget(smp) -> None:
    unlink(paths.rebuild_record_name(smp.job, smp.node))


def record_group(record: dict) -> dict:
    return {key: record[key] for key in ("members", "lens", "padded")}
