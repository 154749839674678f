"""Erasure-coded protection of a node's snapshots by its EC group, and rebuilding a lost node.

Runs inside the SMP, beside its control socket, in background threads:
- protect(step), after the job declares a step complete: every node pulls, for each stripe it holds
  parity for, the k data chunks from their nodes in pieces, encodes its parity chunk into its own shared
  memory and seals it (built). The step is *protected* once every member reports it built; then the
  parity of older steps is dropped and the daemon may overwrite their slots.
- rebuild, when an SMP starts with empty memory and its peers hold parity: it asks the survivors for
  their chunks, decodes its node data and parity, and installs its ranks' slots, which restores verify.

Pull, not push: a parity holder asks for exactly the bytes it encodes next, so memory stays at k pieces
per transfer and a slow or dead peer only stalls the nodes that need it.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from ..ec.stripes import DATA, StripeLayout, rebuild, stripe_parity
from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost
from ..snapshot import segment as seg
from . import nodedata, paritystore
from .groups import Groups
from .paritystore import BUILT, PROTECTED, ParitySet
from .transport import MAX_PAYLOAD, PeerClient, PeerServer, PeerUnavailable, TokenBucket

log = logging.getLogger("inmem_ft.ec")
PIECE = 4 << 20  # bytes per pull: big enough to amortise a round trip, small enough to bound memory
BUILT_WAIT_S = 120.0  # how long a node waits for the rest of its group to finish a step's parity


class Protector:
    def __init__(self, smp, groups: Groups, peers: dict[int, tuple[str, int]], secret: bytes,
                 bandwidth: float | None = None, peer_wait_s: float = 0.0):
        self.smp, self.node, self.groups = smp, smp.node, groups
        # How long an empty SMP waits for unreachable peers before it concludes there is nothing to rebuild:
        # a re-queued job's SMPs start together, and a replacement asking before the survivors listen
        # would start empty.
        self.peer_wait_s = peer_wait_s
        self.members, self.pos = groups.members(self.node), groups.position(self.node)
        missing = [n for n in self.members if n not in peers]
        if missing:
            raise ValueError(f"no address for EC group members {missing} of node {self.node}: list every node of "
                             f"its group in --peers (NODE=HOST:PORT,...)")
        self.layout = StripeLayout(groups.size, groups.m)
        bucket = TokenBucket(bandwidth)
        self.clients = {n: PeerClient(n, peers[n], secret, smp.job, self.node, bucket)
                        for n in self.members if n != self.node}
        self.server = PeerServer(*peers[self.node], secret, smp.job, self.node, self._serve, bucket)
        self.sets: dict[int, ParitySet] = {}
        self.protected: int | None = None
        self.failed: int | None = None
        self.lag_s: float | None = None
        self.completed_at: dict[int, float] = {}
        self.wanted: int | None = None
        self.rebuild_done = threading.Event()
        self.rebuild_error: str | None = None
        self._wake = threading.Condition()

    # ---- lifecycle ------------------------------------------------------------------------------------
    def adopt(self) -> None:
        sets, discarded = paritystore.adopt(self.smp.prefix)
        for why in discarded:
            log.warning("ec node=%d event=discard parity=%s", self.node, why)
        for ps in sets:
            self.sets[ps.step] = ps
            log.info("ec node=%d event=adopt parity step=%d state=%s", self.node, ps.step, ps.state)
        done = [s for s, ps in self.sets.items() if ps.state == PROTECTED]
        self.protected = max(done) if done else None

    def start(self) -> None:
        self.server.start()
        threading.Thread(target=self._run, name="inmem_ft-ec", daemon=True).start()

    def close(self) -> None:
        self.server.close()
        for client in self.clients.values():
            client.close()

    def wipe(self) -> None:
        for ps in self.sets.values():
            ps.drop()
        self.sets.clear()
        self.protected = None

    def notify_complete(self, step: int) -> None:
        """The job declared `step` complete (called under the SMP lock)."""
        self.completed_at.setdefault(step, time.time())
        with self._wake:
            self.wanted = step
            self._wake.notify()

    def restored(self, step: int | None) -> None:
        """The job resumed from `step` (called under the SMP lock): parity of newer steps belongs to an
        abandoned timeline, and the same step numbers will be written again with other bytes."""
        for s in [s for s in self.sets if step is None or s > step]:
            self.sets.pop(s).drop()
            log.info("ec node=%d event=discard parity step=%d reason=job resumed from %s", self.node, s, step)
        done = [s for s, ps in self.sets.items() if ps.state == PROTECTED]
        self.protected = max(done) if done else None
        self.failed = None

    def status(self) -> dict:
        return {"group": self.members, "m": self.groups.m, "protected_step": self.protected,
                "parity_steps": {s: ps.state for s, ps in sorted(self.sets.items())}, "ec_lag_s": self.lag_s,
                "parity_bytes": self.parity_bytes(),
                "rebuild": "running" if not self.rebuild_done.is_set() else (self.rebuild_error or "ok")}

    def parity_bytes(self) -> int:
        return sum(ps.segment.size for ps in self.sets.values())

    # ---- protecting ------------------------------------------------------------------------------------
    def _run(self) -> None:
        self._rebuild_if_empty()
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self.wanted is not None and self.wanted != self.failed
                                    and (self.protected is None or self.wanted > self.protected))
                step = self.wanted
            try:
                self.protect(step)
            except (InmemFTError, ValueError, OSError) as e:
                self.failed = step
                with self.smp.lock:
                    ps = self.sets.get(step)
                    if ps is not None and ps.state != PROTECTED:
                        self.sets.pop(step).drop()
                log.warning("ec node=%d event=protect_failed step=%d reason=%s: the step is not protected; "
                            "the newest protected one stays", self.node, step, e)

    def protect(self, step: int) -> None:
        t0 = time.perf_counter()
        lens = [self._node_data(step).length if n == self.node else
                self.clients[n].call({"op": "describe", "step": step})[0]["length"] for n in self.members]
        padded = self.layout.padded_size(max(lens))
        cs = self.layout.chunk_size(padded)
        group = {"members": self.members, "lens": lens, "padded": padded}
        with self.smp.lock:
            if step in self.sets:
                self.sets.pop(step).drop()
            need = paritystore.RECORD + self.groups.m * cs
            if self.smp.used_bytes() + need > self.smp.budget:
                raise InmemFTError(
                    f"node {self.node} memory budget cannot hold {need / 2**20:.1f} MiB of parity for step {step} "
                    f"beside its slots ({self.smp.used_bytes() / 2**20:.1f} of {self.smp.budget / 2**20:.1f} MiB "
                    f"in use); raise --memory-budget by twice that (old and new parity overlap while encoding)")
            ps = self.sets[step] = ParitySet.create(self.smp.prefix, step, self.groups.m, cs, group)
        k = self.layout.k
        bufs = [np.empty(min(PIECE, cs), dtype=np.uint8) for _ in range(k)]
        with ThreadPoolExecutor(k, thread_name_prefix="inmem_ft-ec-pull") as pool:
            for i, (stripe, p) in enumerate(self.layout.parity_for_node(self.pos)):
                sources = [(self.members[pos], c) for pos, c in self.layout.stripes[stripe].data]
                for a in range(0, cs, PIECE):
                    n = min(PIECE, cs - a)
                    pulls = [pool.submit(self._read, node, step, c * cs + a, bufs[b][:n])
                             for b, (node, c) in enumerate(sources)]
                    data = [f.result() for f in pulls]
                    stripe_parity(self.layout, stripe, data, [p], [ps.chunk(i)[a: a + n]])
        ps.seal(BUILT)
        self._wait_group_built(step)
        with self.smp.lock:
            if self.sets.get(step) is not ps:
                raise InmemFTError(f"step {step} was abandoned while it was being protected (the job resumed "
                                   f"from an older step)")
            ps.seal(PROTECTED)
            self.protected = step
            self.lag_s = round(time.time() - self.completed_at.get(step, time.time()), 3)
            for old in [s for s in self.sets if s < step]:
                self.sets.pop(old).drop()
            self.smp.cond.notify_all()  # a begin may be waiting for the older protected slot to be released
        log.info("ec node=%d event=protected step=%d parity_bytes=%d encode_s=%.3f lag_s=%s", self.node, step,
                 self.groups.m * cs, time.perf_counter() - t0, self.lag_s)

    def _read(self, node: int, step: int, offset: int, into: np.ndarray) -> np.ndarray:
        return self.clients[node].call({"op": "read", "step": step, "off": offset, "len": into.nbytes}, into=into)[1]

    def _wait_group_built(self, step: int) -> None:
        deadline = time.monotonic() + BUILT_WAIT_S
        pending = set(self.clients)
        while pending:
            for n in sorted(pending):
                state = self.clients[n].call({"op": "state"})[0]
                if str(step) in state["built"]:
                    pending.discard(n)
                elif state["failed"] == step:
                    raise PeerUnavailable(f"node {n} failed to build its parity of step {step}")
            if pending and time.monotonic() > deadline:
                raise PeerUnavailable(f"nodes {sorted(pending)} did not finish the parity of step {step} within "
                                      f"{BUILT_WAIT_S:.0f} s")
            if pending:
                time.sleep(0.02)

    def _node_data(self, step: int) -> nodedata.NodeData:
        with self.smp.lock:
            slots = {}
            for rank, rank_slots in self.smp.slots.items():
                for slot in rank_slots:
                    h = slot.header if slot is not None else None
                    if h is not None and h.state == seg.COMMITTED and h.step == step:
                        slots[rank] = slot.segment.buf[: h.data_off + h.data_len]
                if rank not in slots:
                    raise SnapshotCorrupt(f"node {self.node} holds no committed slot of step {step} for rank {rank}")
            if not slots:
                raise SnapshotCorrupt(f"node {self.node} holds no slots of step {step}")
        return nodedata.NodeData(step, slots)

    def _data_steps(self) -> list[int]:
        with self.smp.lock:
            per_rank = [{s.committed_step() for s in slots if s is not None} - {None}
                        for slots in self.smp.slots.values()]
        return sorted(set.intersection(*per_rank)) if per_rank else []

    # ---- serving peers ---------------------------------------------------------------------------------
    def _serve(self, peer: int, header: dict, payload):
        if peer not in self.clients:
            raise InmemFTError(f"node {peer} is not in EC group {self.members}")
        op = header.get("op")
        if op == "describe":
            return {"length": self._node_data(int(header["step"])).length}, ()
        if op == "read":
            off, length = int(header["off"]), int(header["len"])
            if off < 0 or not 0 <= length <= MAX_PAYLOAD:
                raise InmemFTError(f"read of {length} bytes at {off} is out of range")
            return {}, self._node_data(int(header["step"])).pieces(off, length)
        if op == "state":
            with self.smp.lock:
                built = {str(s): ps.record for s, ps in self.sets.items() if ps.state in (BUILT, PROTECTED)}
            return {"built": built, "protected": self.protected, "failed": self.failed, "data": self._data_steps(),
                    "rebuilding": not self.rebuild_done.is_set()}, ()
        if op == "chunk":
            step, stripe = int(header["step"]), int(header["stripe"])
            with self.smp.lock:
                ps = self.sets.get(step)
            if ps is None or ps.state not in (BUILT, PROTECTED):
                raise InmemFTError(f"node {self.node} holds no parity of step {step}")
            i = [s for s, _ in self.layout.parity_for_node(self.pos)].index(stripe)
            return {}, [ps.verified_chunk(i, f"node {self.node}")]
        raise InmemFTError(f"unknown peer operation {op!r}")

    # ---- rebuilding ----------------------------------------------------------------------------------
    def _rebuild_if_empty(self) -> None:
        try:
            with self.smp.lock:
                empty = not self.smp.slots and not self.sets
            if empty:
                self._rebuild()
        except (InmemFTError, ValueError, OSError) as e:
            self.rebuild_error = str(e)
            log.error("ec node=%d event=rebuild_failed reason=%s", self.node, e)
        finally:
            with self.smp.lock:
                self.rebuild_done.set()
                self.smp.cond.notify_all()

    def _peer_states(self) -> dict:
        """What each reachable peer holds, waiting up to peer_wait_s for those not (yet) listening."""
        states, pending = {}, dict(self.clients)
        deadline = time.monotonic() + self.peer_wait_s
        while pending:
            for n, client in list(pending.items()):
                try:
                    states[n] = client.call({"op": "state"})[0]
                    del pending[n]
                except PeerUnavailable:
                    pass
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return states

    def _rebuild(self) -> None:
        states = {n: st for n, st in self._peer_states().items() if not st["rebuilding"] and st["built"]}
        if not states:
            return  # a fresh job: nobody holds parity yet
        lost = [n for n in self.members if n not in states]
        usable = set.intersection(*({int(s) for s in st["built"]} & set(st["data"]) for st in states.values()))
        if len(lost) > self.groups.m or not usable:
            raise SnapshotLost(
                f"nodes {lost} of EC group {self.members} are lost (or hold no common protected step), but its "
                f"parity m={self.groups.m} tolerates at most {self.groups.m}: the in-memory snapshot of node "
                f"{self.node} cannot be rebuilt; restore the job from the next tier (disk)")
        step = max(usable)
        record = next(iter(states.values()))["built"][str(step)]
        cs = self.layout.chunk_size(record["padded"])
        log.info("ec node=%d event=rebuild_start step=%d lost=%s bytes=%d", self.node, step, lost,
                 record["lens"][self.pos])
        with tqdm(total=self.layout.G * self.layout.k, desc=f"rebuild node {self.node} step {step}",
                  unit="chunk", file=sys.stderr, mininterval=0.5) as bar:
            def fetch(pos, kind, index):
                node = self.members[pos]
                if kind == DATA:
                    out = self._read(node, step, index * cs, np.empty(cs, dtype=np.uint8))
                else:
                    out = self.clients[node].call({"op": "chunk", "step": step, "stripe": index})[1]
                bar.update()
                return out
            try:
                mine = rebuild(self.layout, [self.members.index(n) for n in lost], fetch)[self.pos]
            except PeerUnavailable as e:
                raise SnapshotLost(f"rebuilding node {self.node} from group {self.members} failed: {e}; restore "
                                   f"the job from the next tier (disk)") from None
        got_step, ranks = nodedata.split(mine.data[: record["lens"][self.pos]])
        if got_step != step:
            raise SnapshotCorrupt(f"rebuilt node data names step {got_step}, expected {step}")
        for rank, raw in ranks.items():
            self.smp.install_slot(rank, raw)
        ps = ParitySet.create(self.smp.prefix, step, self.groups.m, cs, record_group(record))
        for i, chunk in enumerate(mine.parity):
            ps.chunk(i)[:] = chunk
        ps.seal(PROTECTED)
        with self.smp.lock:
            self.sets[step], self.protected = ps, step
        log.info("ec node=%d event=rebuilt step=%d ranks=%s", self.node, step, sorted(ranks))


def record_group(record: dict) -> dict:
    return {key: record[key] for key in ("members", "lens", "padded")}
