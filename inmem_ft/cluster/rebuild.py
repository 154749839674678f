"""Rebuilding a lost node's slots and parity from its EC group, streamed in bounded pieces.

A replacement SMP (same node index, empty memory) decodes its node data (cluster/nodedata.py) and its parity
chunks one piece of at most `piece` bytes at a time: it pulls the same byte range of k surviving blocks of the
stripe (data through node_read, parity through chunk), decodes the block it lost and writes it straight into
its own segments, created at their final size first (the sizes come from the node-data index and the slot
headers, decoded first). Memory: its own segments plus k + m piece buffers, whatever the node size; no peer
message carries more than one piece, so a node of any size stays under the transport's payload cap.

Never half: each slot's header (its first 4096 bytes) is held aside and written once every other byte is in
place and verified, so an interrupted rebuild leaves blank slots and a parity set still `building`, which a
restarted SMP discards. A record beside the segments (`<prefix>rebuild`) says a rebuild is under way: a
restarted SMP that finds it also drops whatever the interrupted rebuild had installed and starts over.
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

from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost
from ..smp.segments import read_record, unlink, write_record
from ..snapshot import segment as seg
from . import nodedata
from .paritystore import PROTECTED, ParitySet

log = logging.getLogger("inmem_ft.ec")
PIECE = 8 << 20  # default bytes per pull: amortises a round trip, bounds memory to k + m of them
PROGRESS_EVERY_S = 5.0  # how often an operator sees event=rebuild_progress


class StripeReader:
    """Byte ranges of one block of a stripe at `step`, decoded from the same range of k other blocks; a source
    that fails is skipped (for good: `bad`) and the next block of the stripe is asked instead."""

    def __init__(self, protector, step: int, chunk_size: int, lost, pool: ThreadPoolExecutor | None = None):
        self.node, self.members, self.peers = protector.node, protector.members, protector.peers
        self.layout, self.step, self.cs = protector.layout, step, chunk_size
        self.lost = set(lost)  # nodes never asked
        self.bad: dict[int, str] = {}  # node -> why it was skipped
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
                    self.bad[src[1]] = str(e)
                    log.warning("ec node=%d event=skip_source source=%d step=%d stripe=%d reason=%s: asking "
                                "another survivor", self.node, src[1], self.step, stripe, e)
        self.layout.codec.decode(blocks, [want], {want: out})

    def _pull(self, src, n: int) -> np.ndarray:
        block, node, header = src
        buf = self._bufs.get(block)
        if buf is None or buf.nbytes < n:
            buf = self._bufs[block] = np.empty(n, dtype=np.uint8)
        return self.peers.call(node, header, into=buf[:n])[1]

    def _too_few(self, stripe: int, exclude) -> str:
        why = "; ".join(f"node {n}: {r}" for n, r in sorted(self.bad.items())) or "none skipped"
        return (f"stripe {stripe} of step {self.step} has fewer than k={self.layout.k} usable blocks in EC group "
                f"{self.members} (m={self.layout.m}): lost {sorted(self.lost)}"
                f"{f', left out {sorted(exclude)}' if exclude else ''}, skipped: {why}; restore the job from the "
                f"next tier (disk)")


class VerifyFailed(SnapshotCorrupt):
    """Bytes decoded from the survivors do not verify: one of them served corrupt data."""


class Rebuild:
    """One rebuild of node `protector.node`'s data and parity at `step` (its group's parity `record`)."""

    def __init__(self, protector, step: int, record: dict, lost: list[int], piece: int):
        self.p, self.smp, self.step, self.record = protector, protector.smp, step, record
        self.layout, self.pos, self.piece = protector.layout, protector.pos, piece
        self.cs = self.layout.chunk_size(record["padded"])
        self.length = record["lens"][self.pos]
        self.lost = lost
        self.record_name = record_name(self.smp.prefix)

    def run(self) -> None:
        write_record(self.record_name, json.dumps({"step": self.step, "lost": self.lost}))
        try:
            self._run()
        finally:
            # Only a killed SMP leaves the record behind: a failed rebuild already dropped what it installed,
            # and snapshots written after it must not be wiped by the next restart.
            unlink(self.record_name)

    def _run(self) -> None:
        t0 = time.perf_counter()
        log.info("ec node=%d event=rebuild_start step=%d lost=%s bytes=%d piece=%d", self.p.node, self.step,
                 self.lost, self.length, self.piece)
        survivors = [n for n in self.p.members if n not in self.lost]
        spare = len(survivors) > self.layout.k  # a choice of blocks: one survivor can be left out
        with ThreadPoolExecutor(self.layout.k, thread_name_prefix="inmem_ft-ec-rebuild") as pool:
            reader = StripeReader(self.p, self.step, self.cs, self.lost, pool)
            failures = []
            for exclude in [()] + ([(n,) for n in survivors] if spare else []):
                if exclude and exclude[0] in reader.bad:
                    continue  # already skipped by every attempt
                try:
                    ranks, ps = self._attempt(reader, exclude)
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
        log.info("ec node=%d event=rebuilt step=%d ranks=%s bytes=%d seconds=%.3f", self.p.node, self.step,
                 sorted(ranks), self.length, time.perf_counter() - t0)

    def _attempt(self, reader: StripeReader, exclude) -> tuple[list[int], ParitySet]:
        """Decode, write and verify every slot and the parity once; on any failure nothing stays installed."""
        node = self.p.node
        where = f"node {node}'s data of step {self.step} (rebuilt{', without node %d' % exclude[0] if exclude else ''})"

        def read(off, n):  # small reads: the index and the slot headers
            if off < 0 or off + n > self.length:
                raise VerifyFailed(f"{where}: the index points at [{off}, {off + n}), past its {self.length} bytes")
            out = np.empty(n, dtype=np.uint8)
            self._stream(reader, off, out, exclude)
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
                slots[rank] = (start, used, head, self.smp.reserve_copy(rank, size, "peer reconstruction", 0))
            ps = ParitySet.create(self.smp.prefix, self.step, self.layout.m, self.cs,
                                  {**record_group(self.record), "ranks": sorted(index)})
            self._fill(reader, slots, ps, exclude)
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

    def _fill(self, reader: StripeReader, slots: dict, ps: ParitySet, exclude) -> None:
        """Every byte of the node data past the index, and the parity chunks, piece by piece."""
        total = (self.layout.k + self.layout.m) * self.cs
        parts = [(start + seg.HEADER_SIZE, start + used, slot.segment.buf, start)
                 for start, used, _, slot in slots.values() if used > seg.HEADER_SIZE]
        buf = np.empty(min(self.piece, self.cs), dtype=np.uint8)
        last = time.monotonic()
        with tqdm(total=total, desc=f"rebuild node {self.p.node} step {self.step}", unit="B", unit_scale=True,
                  file=sys.stderr, mininterval=0.5) as bar:
            for c in range(self.layout.k):
                for a in range(0, self.cs, self.piece):
                    lo, n = c * self.cs + a, min(self.piece, self.cs - a)
                    if any(s < lo + n and e > lo for s, e, _, _ in parts):
                        self._stream(reader, lo, buf[:n], exclude)
                        for s, e, dst, base in parts:
                            x, y = max(s, lo), min(e, lo + n)
                            if x < y:
                                dst[x - base: y - base] = buf[x - lo: y - lo]
                    bar.update(n)
                    last = self._progress(bar, total, last)
            for i, (stripe, p) in enumerate(self.layout.parity_for_node(self.pos)):
                chunk = ps.chunk(i)
                for a in range(0, self.cs, self.piece):
                    n = min(self.piece, self.cs - a)
                    reader.decode(stripe, self.layout.k + p, a, chunk[a: a + n], exclude)
                    bar.update(n)
                    last = self._progress(bar, total, last)

    def _progress(self, bar, total: int, last: float) -> float:
        if time.monotonic() - last < PROGRESS_EVERY_S:
            return last
        log.info("ec node=%d event=rebuild_progress step=%d done=%d of=%d", self.p.node, self.step, bar.n, total)
        return time.monotonic()

    def _stream(self, reader: StripeReader, off: int, out: np.ndarray, exclude) -> None:
        """Node-data bytes [off, off+len(out)) of this node, decoded piece by piece across its chunks."""
        pos, end = off, off + out.nbytes
        while pos < end:
            c, a = divmod(pos, self.cs)
            n = min(end - pos, self.cs - a, self.piece)
            stripe = (self.pos - self.layout.m - c) % self.layout.G  # chunk c of this node is data block c there
            reader.decode(stripe, c, a, out[pos - off: pos - off + n], exclude)
            pos += n


def record_name(prefix: str) -> str:
    return f"{prefix}rebuild"


def interrupted(prefix: str) -> dict | None:
    """The record of a rebuild that never finished (the SMP was killed during it), or None."""
    text = read_record(record_name(prefix))
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def record_group(record: dict) -> dict:
    return {key: record[key] for key in ("members", "lens", "padded")}
