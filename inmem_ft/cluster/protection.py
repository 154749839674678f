"""Erasure-coded protection of a node's snapshots by its EC group, and rebuilding a lost node.

Runs inside the SMP, beside its control socket, in background threads:
- protect(step), after the job declares a step complete: every node pulls, for each stripe it holds
  parity for, the k data chunks from their nodes in pieces, encodes its parity chunk into its own shared
  memory and seals it (built). The step is *protected* once every member reports it built; then the
  parity of older steps is dropped and the daemon may overwrite their slots. The newest complete step is
  protected whenever it is not yet, not only when a `complete` asks for it: after the job resumes from a
  step (a trainer killed between its commit and the job's agreement leaves a step every rank holds that no
  `complete` ever named, and the restart resumes from it), and after an SMP restart that adopted a complete
  step its predecessor had not protected. Each node logs `event=protected step=N` once the group has it.
  Members that go before a node saw their parity built (at most m, every other member built its own) leave the
  step decodable without them: the node keeps it built, so readers decode the lost members' data of that step
  rather than of the older protected one; a resume from it makes it the protected step (Protector.restored).
- rebuild, when an SMP starts with empty memory and its peers hold parity: it streams the survivors'
  chunks in pieces, decodes its node data and parity straight into its segments and installs its ranks'
  slots once they verify (cluster/rebuild.py).
- decode_range, for reads of a lost member's slots (cluster/slotreads.py): any byte range of its node
  data, from the same range of k surviving chunks of each stripe it touches.
- regroup, when the job goes on with another set of nodes (a shrink onto the survivors of a node loss, a
  grow): the agent tells its SMP the nodes of the new rendezvous, and steps from then on are protected by the
  groups formed over them (cluster/groups.py). Parity of older steps keeps the group it was encoded by, in its
  record: a restore reads a lost node's shards of the step the job shrank from through that group, until the
  first step protected by the new groups replaces it.

Pull, not push: a parity holder asks for exactly the bytes it encodes next, so memory stays at k pieces
per transfer and a slow or dead peer only stalls the nodes that need it.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from .. import events
from ..ec.stripes import StripeLayout, stripe_parity
from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost
from . import nodedata, paritystore, rebuild, transport
from .groups import Groups
from .paritystore import BUILDING, BUILT, PROTECTED, ParitySet
from .peers import Peers
from .rebuild import StripeReader
from .transport import MAX_PAYLOAD, PeerRefused, PeerUnavailable

log = logging.getLogger("inmem_ft.ec")
PIECE = 4 << 20  # bytes per pull: big enough to amortise a round trip, small enough to bound memory
BUILT_WAIT_S = 120.0  # how long a node waits for the rest of its group to finish a step's parity
# How long a protection the job's restart asked for keeps waiting on a member that reports the step failed:
# each member's trainers reset that (restored) within moments of each other, and the member that asks first
# must not take a failure from before the restart for the member's answer now.
PEER_FAILED_GRACE_S = 5.0
# Waits before each retry of a protection that failed for a transient reason (a peer unreachable or too slow to
# answer). The first is longer than the transport's QUIET_S, in which a peer that timed out is not dialled again.
RETRY_DELAYS_S = (transport.QUIET_S + 1.0, 2 * (transport.QUIET_S + 1.0))
# How long an empty SMP keeps asking group members that did not answer, before a rebuild counts them out: a
# member a loaded host lets answer late is slow, not lost (two more rounds past the transport's quiet period).
REACH_RETRY_S = 2 * (transport.QUIET_S + 1.0)


class PeerGaveUp(InmemFTError):
    """A member of the group reports that it gave up protecting the step: retrying here cannot complete it."""


class BuiltWithout(PeerUnavailable):
    """Members of the group went unreachable before this node saw their parity of the step built, but every other
    member reported its own built: without the unreachable ones (at most m), the step decodes from the rest."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


class Group(NamedTuple):
    """This node's EC group as one step's parity was (or is to be) encoded by it."""

    members: list[int]
    pos: int  # this node's position in it
    layout: StripeLayout


@functools.lru_cache(maxsize=None)
def _layout(size: int, m: int) -> StripeLayout:
    return StripeLayout(size, m)


class Protector:
    def __init__(self, smp, groups: Groups, peers: Peers, peer_wait_s: float = 0.0, piece: int = rebuild.PIECE,
                 max_read: int = MAX_PAYLOAD):
        self.smp, self.node = smp, smp.node
        # How long an empty SMP waits for unreachable peers before it concludes there is nothing to rebuild:
        # a re-queued job's SMPs start together, and a replacement asking before the survivors listen
        # would start empty.
        self.peer_wait_s = peer_wait_s
        self.piece = piece  # bytes per pull of a rebuild (cluster/rebuild.py)
        self.max_read = max_read  # the largest range one node_read or chunk read of a peer may ask
        self.peers, self.m, self.size = peers, groups.m, groups.largest  # m and G as configured
        self._form(groups)
        self.formed: list[Groups | None] = [groups]  # every set of groups since the start, the current last
        self.regrouped: list[int] | None = None  # the nodes the groups were last formed over again
        for op, handler in (("describe", self._describe), ("node_read", self._node_read), ("state", self._state),
                            ("chunk", self._chunk)):
            peers.register(op, handler, self.partners)
        self.sets: dict[int, ParitySet] = {}
        self.protected: int | None = None
        # The step whose protection failed here, given up or waiting for a retry: a begin may overwrite the older
        # protected step's slots (the SMP's pins), so a retry never holds off the next snapshot.
        self.failed: int | None = None
        self.failed_why = ""  # what made `failed` fail
        # The step this node gave up protecting: what its peers are told, so that they stop waiting for it.
        self.gave_up: int | None = None
        self.lag_s: float | None = None
        self.completed_at: dict[int, float] = {}
        self.wanted: int | None = None
        self.why: str = "complete"  # why `wanted` is wanted, for the log line of a protection that is not routine
        self._epoch = 0  # bumped by restored(): a failure of a protection begun before says nothing of now
        self._stopping = False  # set by stop(): no protection starts, and no retry waits, any more
        self.rebuild_done = threading.Event()
        self.rebuild_error: str | None = None
        self.rebuilds = 0  # rebuilds of this node's slots from the group that finished, since this SMP started
        self._wake = threading.Condition()

    # ---- the groups ------------------------------------------------------------------------------------
    def _form(self, groups: Groups | None) -> None:
        """Protect new steps by `groups` (None: by none, too few nodes are left for m)."""
        members = groups.members(self.node) if groups is not None else [self.node]
        missing = [n for n in members if n not in self.peers.addresses]
        if missing:
            raise ValueError(f"no address for EC group members {missing} of node {self.node}: list every node of "
                             f"its group in --peers (NODE=HOST:PORT,...)")
        self.groups, self.members, self.pos = groups, members, members.index(self.node)
        self.layout = _layout(len(members), self.m) if groups is not None else None
        self.clients = {n: self.peers.clients[n] for n in members if n != self.node}

    def regroup(self, nodes: list[int]) -> dict:
        """The job runs on the SMPs of `nodes` now (the agents' new rendezvous): new steps are protected by groups
        formed over them, G and m as configured, G reduced where fewer nodes are left (none where m >= their
        number). Returns {group, changed, text}; each change is one ec line."""
        groups = Groups.over(nodes, self.size, self.m)
        with self.smp.lock:
            if groups == self.groups:
                return {"group": self.members, "changed": False, "text": ""}
            self._form(groups)
            self.formed.append(groups)
            self.regrouped = sorted(nodes)
            # What failed by the old groups says nothing of the new: the next snapshot is protected afresh.
            self.failed = self.gave_up = None
            self._epoch += 1
        if groups is None:
            text = (f"{len(nodes)} node(s) left, too few for m={self.m} (a group needs more than m nodes): the steps "
                    f"from now on are not protected; a node loss falls to the disk tier")
        else:
            text = (f"the steps from the next snapshot on are protected by EC group {self.members} of "
                    f"{[list(s) for s in groups.sets]}")
            if groups.largest < self.size:
                text += f" (G={groups.largest}, fewer than the configured {self.size}: {len(nodes)} nodes are left)"
        reduced = groups is None or groups.largest < self.size
        events.emit(events.Source("smp", self.node), "ec", "regrouped", say=log.warning if reduced else log.info,
                    nodes=sorted(nodes), group=self.members, m=self.m, text=text)
        return {"group": self.members if groups is not None else [], "changed": True, "text": text}

    def partners(self) -> set[int]:
        """The nodes that share, or shared, an EC group with this one: they may ask for its parity and node data."""
        with self.smp.lock:
            out = {n for g in self.formed if g is not None and self.node in g.nodes for n in g.members(self.node)}
            return out | {n for ps in self.sets.values() for n in ps.record.get("members", ())}

    def groups_with(self, node: int) -> list[list[int]]:
        """The EC groups `node` was a member of, the newest first: whose members may hold parity of its steps."""
        out = []
        for g in reversed(self.formed):
            if g is not None and node in g.nodes and g.members(node) not in out:
                out.append(g.members(node))
        return out

    def group_of(self, step: int) -> Group:
        """The group `step`'s parity here was encoded by (its record names the members)."""
        record = self._parity(step).record
        members = list(record["members"])
        return Group(members, members.index(self.node), _layout(len(members), record["m"]))

    def holds_parity_of(self, node: int, step: int) -> bool:
        with self.smp.lock:
            ps = self.sets.get(step)
            return ps is not None and ps.state in (BUILT, PROTECTED) and node in ps.record.get("members", ())

    # ---- lifecycle ------------------------------------------------------------------------------------
    def adopt(self) -> None:
        sets, discarded, refused = paritystore.adopt(self.smp.prefix, rebuild.interrupted(self.smp) is not None)
        for why in discarded:
            log.warning("ec node=%d event=discard parity=%s", self.node, why)
        for why in refused:
            log.warning("ec node=%d event=refused parity=%s", self.node, why)
        for ps in sets:
            self.sets[ps.step] = ps
            log.info("ec node=%d event=adopt parity step=%d state=%s", self.node, ps.step, ps.state)
        self.protected = self._newest_protected()

    def _newest_protected(self) -> int | None:
        done = [s for s, ps in self.sets.items() if ps.state == PROTECTED]
        return max(done) if done else None

    def start(self) -> None:
        threading.Thread(target=self._run, name="inmem_ft-ec", daemon=True).start()

    def stop(self) -> None:
        """The SMP is stopping: a retry waiting for its delay gives up now, and none begins."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()

    def wipe(self) -> None:
        for ps in self.sets.values():
            ps.drop()
        self.sets.clear()
        self.protected = None

    def notify_complete(self, step: int) -> None:
        """The job declared `step` complete (called under the SMP lock)."""
        if self.groups is None:  # nothing to protect it with: it is as final as it gets
            self.smp.release_moved(step)
            return
        self.completed_at.setdefault(step, time.time())
        with self._wake:
            self.wanted, self.why = step, "complete"
            self._wake.notify()

    def restored(self, step: int | None) -> None:
        """The job resumed from `step` (called under the SMP lock): parity of newer steps belongs to an
        abandoned timeline, and the same step numbers will be written again with other bytes."""
        for s in [s for s in self.sets if step is None or s > step]:
            self.sets.pop(s).drop()
            log.info("ec node=%d event=discard parity step=%d reason=job resumed from %s", self.node, s, step)
        ps = self.sets.get(step)
        if ps is not None and ps.state == BUILT and ps.built_without:
            # Its survivors decoded the members lost after the build from it, as from a protected step (a rebuild
            # of one seals its parity protected too): protected here now, not encoded again, and so not dropped
            # while the survivors' other ranks may still be reading the lost members' data through it.
            ps.seal(PROTECTED)
            for old in [s for s in self.sets if s < step]:
                self.sets.pop(old).drop()
            log.info("ec node=%d event=protected_by_resume step=%d lost=%s reason=the job resumed from it, kept "
                     "built when those members went before they were seen built", self.node, step, ps.built_without)
        self.protected = self._newest_protected()
        self.failed = self.gave_up = None
        self._epoch += 1
        # The step resumed from is the newest complete one now: protect it unless it is already (a trainer
        # killed between its commit and the job's agreement leaves one that no `complete` ever named).
        self._want_held(step, f"the job resumed from step {step}")

    def _want_held(self, step: int | None, why: str) -> None:
        """Protect `step` next if every rank that runs here holds it committed and it is not protected (called
        under the SMP lock); else protect nothing until the next `complete`."""
        if step is not None and step not in self.smp.complete_steps_held():
            step = None
        if step is not None and step != self.protected:
            self.completed_at.setdefault(step, time.time())
        with self._wake:
            self.wanted, self.why = step, why
            self._wake.notify()

    def resume(self) -> None:
        """At start, once any rebuild is done: the job's complete step this SMP adopted (its predecessor stopped
        before protecting it, or while protecting it) is protected now."""
        with self.smp.lock:
            step = self.smp.complete_step
            if step is not None and step != self.protected:
                self._want_held(step, f"step {step} is complete but not protected when this SMP started")

    def status(self) -> dict:
        return {"group": self.members if self.groups is not None else [], "m": self.m,
                "protected_step": self.protected,
                "degraded": self.degraded(),
                "parity_steps": {s: ps.state for s, ps in sorted(self.sets.items())}, "ec_lag_s": self.lag_s,
                "parity_bytes": self.parity_bytes(), "rebuilds": self.rebuilds,
                "rebuild": "running" if not self.rebuild_done.is_set() else (self.rebuild_error or "ok")}

    def degraded(self) -> str | None:
        """Why the job's newest steps here are not protected against a node loss: no group is left (too few
        nodes for m), the newest step this node tried to protect is not while no newer one is, or the groups
        were formed again (the job shrank or grew) and no step is protected by them yet. None when protected."""
        if self.groups is None:
            return (f"unprotected: the job runs on {len(self.regrouped or [])} node(s), too few for m={self.m}; a "
                    f"node loss falls to the disk tier")
        if self.failed is not None and (self.protected is None or self.protected <= self.failed):
            return f"step {self.failed} is not protected: {self.failed_why}"
        if self.regrouped is None:
            return None
        with self.smp.lock:
            ps = self.sets.get(self.protected) if self.protected is not None else None
            by = list(ps.record["members"]) if ps is not None else None
        if by == self.members:
            return None
        return (f"the EC groups were formed again over nodes {self.regrouped} and protect no step yet"
                + (f" (step {self.protected} is protected by the old group {by})" if by else "")
                + ": a node loss before the next snapshot is protected falls to the disk tier")

    def parity_bytes(self) -> int:
        return sum(ps.segment.size for ps in self.sets.values())

    # ---- protecting ------------------------------------------------------------------------------------
    def _run(self) -> None:
        self._rebuild_if_empty()
        self.resume()
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or (
                    self.groups is not None and self.wanted is not None and self.wanted != self.gave_up
                    and (self.protected is None or self.wanted > self.protected)))
                if self._stopping:
                    return
                step, why, epoch = self.wanted, self.why, self._epoch
            if why != "complete":
                events.emit(events.Source("smp", self.node), "ec", "protect", say=log.info, step=step, reason=why)
            self._protect_retrying(step, PEER_FAILED_GRACE_S if why != "complete" else 0.0, epoch)

    def _protect_retrying(self, step: int, peer_failed_grace_s: float, epoch: int) -> None:
        """protect(step), again after a transient failure (a peer unreachable or too slow to answer) unless a newer
        step, a resume or the SMP's stop superseded it meanwhile: else the newest step stays unprotected until the
        next snapshot. A member only reports the step failed once it gives up, so the rest of its group waits for
        its retry; its own next snapshot does not (see `failed`)."""
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None), 1):
            try:
                self.protect(step, peer_failed_grace_s)
                return
            except (InmemFTError, ValueError, OSError) as e:
                with self.smp.lock:
                    ps = self.sets.get(step)
                    if ps is not None and ps.state == BUILT and isinstance(e, BuiltWithout):
                        ps.built_without = e.lost
                    # Parity that every member still reachable built stays, whatever a retry meets next (the lost
                    # member unreachable, or rebuilding from this very parity), unless a member gave up: it holds none.
                    if ps is not None and ps.state != PROTECTED and (not ps.built_without or isinstance(e, PeerGaveUp)):
                        self.sets.pop(step).drop()
                    if self._epoch == epoch:  # else the job resumed meanwhile, and wanted says what to protect
                        self.failed, self.failed_why = step, str(e)
                error = e
            transient = isinstance(error, PeerUnavailable) and not isinstance(error, PeerRefused)
            superseded = self._superseded(step, epoch)
            if delay is None or not transient or superseded:
                break
            log.warning("ec node=%d event=protect_retry step=%d attempt=%d of %d delay_s=%.0f reason=%s", self.node,
                        step, attempt + 1, len(RETRY_DELAYS_S) + 1, delay, error)
            with self._wake:
                self._wake.wait_for(lambda: self._superseded(step, epoch), delay)
            superseded = self._superseded(step, epoch)
            if superseded:
                break
        with self.smp.lock:
            if self._epoch == epoch:
                self.gave_up = step
        if self._stopping:  # not a failure of the group: nothing is lost that the stop itself does not lose
            log.info("ec node=%d event=protect_stopped step=%d reason=%s: the SMP is stopping; the step is not "
                     "protected", self.node, step, error)
            return
        with self.smp.lock:
            kept = step in self.sets
        events.emit(events.Source("smp", self.node), "ec", "protect_failed", say=log.warning, step=step,
                    reason=f"{error}" + (f" (not retried: {superseded})" if superseded else ""),
                    text="the step is not protected everywhere; its parity stays built here, decodable by the "
                         "members that built it" if kept else
                    "the step is not protected; the group keeps the parity of the older protected step")

    def _superseded(self, step: int, epoch: int) -> str | None:
        """Why protecting `step`, begun in `epoch`, is moot now, if it is."""
        if self._stopping:
            return "the SMP is stopping"
        if self._epoch != epoch:
            return "the job resumed meanwhile"
        if self.wanted != step:
            return f"step {self.wanted} is wanted now" if self.wanted is not None else "the job wants no step now"
        return None

    def protect(self, step: int, peer_failed_grace_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        with self.smp.lock:  # the groups as they are now: a regroup meanwhile changes only later protections
            if self.groups is None:
                raise InmemFTError(f"no EC group: too few nodes are left for m={self.m}")
            now, clients = Group(self.members, self.pos, self.layout), dict(self.clients)
        lens = [self._node_data(step).length if n == self.node else
                clients[n].call({"op": "describe", "step": step})[0]["length"] for n in now.members]
        padded = now.layout.padded_size(max(lens))
        cs = now.layout.chunk_size(padded)
        group = {"members": now.members, "lens": lens, "padded": padded,
                 "ranks": sorted(self.smp.committed_views(step))}
        with self.smp.lock:
            ps = self.sets.get(step)
            if ps is not None and ps.state == BUILT and all(ps.record.get(key) == v for key, v in group.items()):
                # Built from these very bytes before a restart cut its protection off: the group only has to
                # finish; encoding it again would leave this member without parity of the step meanwhile.
                log.info("ec node=%d event=reuse parity step=%d state=built", self.node, step)
                reused = True
            else:
                reused = False
                if ps is not None:
                    self.sets.pop(step).drop()
        if not reused:
            ps = self._encode(step, cs, group, now, clients)
        self._wait_group_built(step, clients, peer_failed_grace_s)
        with self.smp.lock:
            if self.sets.get(step) is not ps:
                raise InmemFTError(f"step {step} was abandoned while it was being protected (the job resumed "
                                   f"from an older step)")
            ps.seal(PROTECTED)
            self.protected = step
            self.lag_s = round(time.time() - self.completed_at.get(step, time.time()), 3)
            for old in [s for s in self.sets if s < step]:
                self.sets.pop(old).drop()
            self.smp.release_moved(step)
        events.emit(events.Source("smp", self.node), "ec", "protected", say=log.info, step=step,
                    parity_bytes=self.m * cs, encode_s=time.perf_counter() - t0, lag_s=self.lag_s,
                    group=now.members)

    def _encode(self, step: int, cs: int, group: dict, now: Group, clients: dict) -> ParitySet:
        """This node's parity chunks of `step`, pulled and encoded into a new parity set, sealed built."""
        with self.smp.lock:
            if self._stopping:  # a wipe may have run: a parity set made now would outlive the SMP
                raise InmemFTError(f"node {self.node}'s SMP is stopping")
            need = paritystore.RECORD + self.m * cs
            if self.smp.used_bytes() + need > self.smp.budget:
                # A step kept built beside the older protected one is a third parity set: first give up parity of
                # steps whose slots here are gone (overwritten once a protection failed), which the group can no
                # longer decode through this node's data.
                held = self.smp.complete_steps_held()
                for old in [s for s in self.sets if s < step and s not in held]:
                    self.sets.pop(old).drop()
                    log.info("ec node=%d event=discard parity step=%d reason=its slots here were overwritten, and "
                             "step %d's parity needs the room", self.node, old, step)
                self.protected = self._newest_protected()
            if self.smp.used_bytes() + need > self.smp.budget:
                raise InmemFTError(
                    f"node {self.node} memory budget cannot hold {need / 2**20:.1f} MiB of parity for step {step} "
                    f"beside its slots ({self.smp.used_bytes() / 2**20:.1f} of {self.smp.budget / 2**20:.1f} MiB "
                    f"in use); raise --memory-budget by twice that (old and new parity overlap while encoding)")
            ps = self.sets[step] = ParitySet.create(self.smp.prefix, step, self.m, cs, group)
        k = now.layout.k
        bufs = [np.empty(min(PIECE, cs), dtype=np.uint8) for _ in range(k)]
        with ThreadPoolExecutor(k, thread_name_prefix="inmem_ft-ec-pull") as pool:
            for i, (stripe, p) in enumerate(now.layout.parity_for_node(now.pos)):
                sources = [(now.members[pos], c) for pos, c in now.layout.stripes[stripe].data]
                for a in range(0, cs, PIECE):
                    n = min(PIECE, cs - a)
                    pulls = [pool.submit(self._read, clients[node], step, c * cs + a, bufs[b][:n])
                             for b, (node, c) in enumerate(sources)]
                    data = [f.result() for f in pulls]
                    stripe_parity(now.layout, stripe, data, [p], [ps.chunk(i)[a: a + n]])
        ps.seal(BUILT)
        return ps

    @staticmethod
    def _read(client, step: int, offset: int, into: np.ndarray) -> np.ndarray:
        return client.call({"op": "node_read", "step": step, "off": offset, "len": into.nbytes}, into=into)[1]

    def _wait_group_built(self, step: int, clients: dict, peer_failed_grace_s: float = 0.0) -> None:
        start = time.monotonic()
        deadline = start + BUILT_WAIT_S
        pending = set(clients)
        while pending:
            unreachable: dict[int, PeerUnavailable] = {}
            for n in sorted(pending):
                try:
                    state = clients[n].call({"op": "state"})[0]
                except PeerUnavailable as e:
                    if isinstance(e, PeerRefused):
                        raise
                    unreachable[n] = e  # the rest of the round says whether the step decodes without it
                    continue
                if str(step) in state["built"]:
                    pending.discard(n)
                elif state["failed"] == step and time.monotonic() > start + peer_failed_grace_s:
                    raise PeerGaveUp(f"node {n} failed to build its parity of step {step}")
            if unreachable:
                if pending == set(unreachable) and len(pending) <= self.m:
                    why = "; ".join(f"node {n}: {e}" for n, e in sorted(unreachable.items()))
                    raise BuiltWithout(f"nodes {sorted(pending)} went unreachable before their parity of step "
                                       f"{step} was seen built; every other member built its own ({why})",
                                       sorted(pending))
                raise unreachable[min(unreachable)]
            if pending and time.monotonic() > deadline:
                raise PeerUnavailable(f"nodes {sorted(pending)} did not finish the parity of step {step} within "
                                      f"{BUILT_WAIT_S:.0f} s")
            if pending:
                time.sleep(0.02)

    def _node_data(self, step: int) -> nodedata.NodeData:
        # Once parity of `step` exists, its node data is the ranks it was encoded from: a rank pulled here
        # since (it moved to this node) must not change the bytes the group decodes against.
        with self.smp.lock:
            ps = self.sets.get(step)
        slots = self.smp.committed_views(step, ps.record.get("ranks") if ps is not None else None)
        if not slots:
            raise SnapshotCorrupt(f"node {self.node} holds no slots of step {step}")
        return nodedata.NodeData(step, slots)

    # ---- serving peers ---------------------------------------------------------------------------------
    def _describe(self, peer, header, payload):
        return {"length": self._node_data(int(header["step"])).length}, ()

    def _node_read(self, peer, header, payload):
        off, length = int(header["off"]), int(header["len"])
        if off < 0 or not 0 <= length <= self.max_read:
            raise InmemFTError(f"read of {length} bytes at {off} is out of range (at most {self.max_read} bytes)")
        return {}, self._node_data(int(header["step"])).pieces(off, length)

    def _state(self, peer, header, payload):
        with self.smp.lock:
            built = {str(s): ps.record for s, ps in self.sets.items() if ps.state in (BUILT, PROTECTED)}
        return {"built": built, "protected": self.protected, "failed": self.gave_up,
                "data": self.smp.complete_steps_held(), "rebuilding": not self.rebuild_done.is_set()}, ()

    def _chunk(self, peer, header, payload):
        """This node's parity chunk of a stripe, or bytes [off, off+len) of it."""
        step, stripe = int(header["step"]), int(header["stripe"])
        ps, group = self._parity(step), self.group_of(step)
        i = [s for s, _ in group.layout.parity_for_node(group.pos)].index(stripe)
        chunk = ps.verified_chunk(i, f"node {self.node}")
        off = int(header.get("off", 0))
        length = int(header.get("len", len(chunk) - off))
        if off < 0 or length < 0 or off + length > len(chunk):
            raise InmemFTError(f"bytes [{off}, {off + length}) leave parity chunk {i} of {len(chunk)} bytes")
        if length > self.max_read:
            raise InmemFTError(f"read of {length} bytes of parity chunk {i} is over the {self.max_read}-byte limit")
        return {}, [chunk[off: off + length]]

    def _parity(self, step: int) -> ParitySet:
        with self.smp.lock:
            ps = self.sets.get(step)
        if ps is None or ps.state not in (BUILT, PROTECTED):
            raise SnapshotLost(f"node {self.node} holds no parity of step {step}")
        return ps

    # ---- reading a lost member's data ------------------------------------------------------------------
    def parity_steps(self) -> list[int]:
        with self.smp.lock:
            return sorted(s for s, ps in self.sets.items() if ps.state in (BUILT, PROTECTED))

    def lost_length(self, lost: int, step: int) -> int:
        """Length of the node data of group member `lost` at `step`, from this node's parity record."""
        return self._parity(step).record["lens"][self.group_of(step).members.index(lost)]

    def decode_range(self, lost: int, step: int, start: int, length: int) -> np.ndarray:
        """Bytes [start, start+length) of member `lost`'s node data at `step`, decoded from the same byte
        range of k surviving chunks of each stripe it touches (RS works bytewise)."""
        cs, group = self._parity(step).record["chunk_size"], self.group_of(step)
        if start < 0 or length < 0 or start + length > cs * group.layout.k:
            raise InmemFTError(f"bytes [{start}, {start + length}) leave node {lost}'s data at step {step}")
        out = np.zeros(length, dtype=np.uint8)
        # A reader asks the group for a member's bytes only once it could not reach that member.
        StripeReader(self, step, cs, {lost}, lost_as="unreachable", group=group).node_bytes(
            group.members.index(lost), start, out, self.piece)
        return out

    # ---- rebuilding ----------------------------------------------------------------------------------
    def _rebuild_if_empty(self) -> None:
        try:
            was = rebuild.interrupted(self.smp)
            with self.smp.lock:
                empty = not self.smp.committed() and all(ps.state == BUILDING for ps in self.sets.values())
            if empty or was is not None:
                self._rebuild(was)
        except (InmemFTError, ValueError, OSError) as e:
            self.rebuild_error = str(e)
            events.emit(events.Source("smp", self.node), "ec", "rebuild_failed", say=log.error, reason=f"{e}")
        finally:
            with self.smp.lock:
                self.rebuild_done.set()
                self.smp.cond.notify_all()

    def _peer_states(self, wait_s: float, only=None) -> tuple[dict, dict]:
        """(node -> state, node -> why unreachable) of the peers (of `only`, default all), asking those not
        answering again until `wait_s` has passed (each round waits out the transport's quiet period)."""
        states, unreachable = {}, {}
        pending = {n: c for n, c in self.clients.items() if only is None or n in only}
        deadline = time.monotonic() + wait_s
        while pending:
            for n, client in list(pending.items()):
                try:
                    states[n] = client.call({"op": "state"})[0]
                    del pending[n]
                    unreachable.pop(n, None)
                except PeerUnavailable as e:
                    unreachable[n] = e
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(min(transport.QUIET_S + 0.5, max(0.5, deadline - time.monotonic())))
        return states, unreachable

    def _rebuild(self, was: dict | None) -> None:
        """`was`: the record of a rebuild this node's previous SMP did not finish, or None."""
        states, unreachable = self._peer_states(self.peer_wait_s)
        holders = self._holders(states)
        if not holders:
            if was is not None:
                rebuild.forget(self.smp)
                raise SnapshotLost(f"node {self.node} was rebuilding step {was.get('step')} when its SMP stopped, "
                                   f"and no member of EC group {self.members} holds parity now; restore the job "
                                   f"from the next tier (disk)")
            return  # a fresh job: nobody holds parity yet
        if was is None and self._holds_data():
            # Empty when this SMP started, but the job committed here while the group was asked (a loaded host
            # answers late): parity the group built since covers these very slots, not a lost node's.
            log.info("ec node=%d event=rebuild_skip reason=the job committed snapshots here while its group was "
                     "asked: this node is not a replacement", self.node)
            return
        if unreachable and len(self.members) - 1 - len(holders) > self.m - 1:
            # A peer that answered late is slow, not lost: ask it again (past the transport's quiet period)
            # before the rebuild counts it out.
            log.warning("ec node=%d event=rebuild_wait nodes=%s reason=%s", self.node, sorted(unreachable),
                        "; ".join(f"node {n}: {e}" for n, e in sorted(unreachable.items())))
            more, unreachable = self._peer_states(max(self.peer_wait_s, REACH_RETRY_S), only=set(unreachable))
            holders |= self._holders(more)
            if was is None and self._holds_data():
                log.info("ec node=%d event=rebuild_skip reason=the job committed snapshots here while its group "
                         "was asked: this node is not a replacement", self.node)
                return
        lost = [n for n in self.members if n not in holders]
        usable = set.intersection(*({int(s) for s in st["built"]} & set(st["data"]) for st in holders.values()))
        if len(lost) > self.m or not usable:
            why = "; ".join(f"node {n}: {_rebuild_why(n, self.node, states, unreachable)}" for n in lost)
            raise SnapshotLost(
                f"nodes {lost} of EC group {self.members} are lost, unreachable or hold no common protected step, "
                f"but its parity m={self.m} tolerates at most {self.m}: the "
                f"in-memory snapshot of node {self.node} cannot be rebuilt; restore the job from the next tier "
                f"(disk) ({why})")
        step = max(usable)
        rebuild.Rebuild(self, step, next(iter(holders.values()))["built"][str(step)], lost, self.piece, was).run()
        self.rebuilds += 1

    def _holders(self, states: dict) -> dict:
        """The peers that can serve this node's rebuild, each state's `built` cut to the parity encoded by this
        node's group: parity of groups formed over the survivors of a shrink without this node rebuilds
        nothing of it (it comes back empty, as a new node)."""
        out = {}
        for n, st in states.items():
            built = {s: r for s, r in st["built"].items() if r.get("members") == self.members}
            if not st["rebuilding"] and built:
                out[n] = {**st, "built": built}
        return out

    def _holds_data(self) -> bool:
        with self.smp.lock:
            return bool(self.smp.committed())


def _rebuild_why(n: int, me: int, states: dict, unreachable: dict) -> str:
    """Why member `n` cannot serve node `me`'s rebuild, for the error that names it."""
    if n == me:
        return "this node, empty"
    if n in unreachable:
        return f"unreachable ({unreachable[n]})"
    st = states.get(n)
    if st is None:
        return "did not answer"
    if st["rebuilding"]:
        return "rebuilding itself"
    return "holds no parity" if not st["built"] else f"holds parity of steps {sorted(map(int, st['built']))}"
