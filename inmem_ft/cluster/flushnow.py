"""`flush`: the job's newest complete step on disk on every node now (`inmem-ft smp flush`, a trainer's
`flush()`), for planned maintenance. The SMP asked forwards the step to every node's SMP over the peer links
(itself included), which queues it on its disk tier's writer, then polls them until each has it on disk, one
says why it cannot, or the time is up."""
from __future__ import annotations

import time

from .transport import PeerUnavailable
from ..errors import InmemFTError
from ..smp import fields

POLL_S = 0.2
DEFAULT_TIMEOUT_S = 600.0


class FlushNow:
    OPS = ("flush",)

    def __init__(self, smp, peers):
        self.smp, self.peers = smp, peers
        peers.register("flush", self._peer_flush)

    def _peer_flush(self, peer: int, header: dict, payload):
        if self.smp.disk is None:
            raise InmemFTError(f"node {self.smp.node} has no disk tier: its SMP was started without --persist-dir")
        return self.smp.disk.request(fields.step(header)), []

    def handle(self, op: str, msg: dict) -> tuple[dict, list]:
        timeout_s = msg.get("timeout_s") or DEFAULT_TIMEOUT_S
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise InmemFTError(f"flush: timeout_s {timeout_s!r} must be a positive number of seconds")
        step = self.smp.complete_step
        if step is None:
            raise InmemFTError(f"node {self.smp.node}'s SMP knows of no complete step yet: nothing to flush")
        deadline, waiting, done = time.monotonic() + timeout_s, set(self.peers.nodes), {}
        while True:
            for node in sorted(waiting):
                try:
                    reply, _ = self.peers.call(node, {"op": "flush", "step": step})
                except (PeerUnavailable, InmemFTError) as e:
                    raise InmemFTError(f"step {step} is not on disk on node {node}: {e}") from None
                if reply.get("error"):
                    raise InmemFTError(f"step {step} is not on disk on node {node}: its flush failed: "
                                       f"{reply['error']}")
                if reply["flushed_step"] is not None and reply["flushed_step"] >= step:
                    done[node] = reply["flushed_step"]
                    waiting.discard(node)
            if not waiting:
                return {"step": step, "nodes": {str(n): s for n, s in sorted(done.items())}}, []
            if time.monotonic() > deadline:
                raise InmemFTError(f"step {step} is not on disk on node(s) {sorted(waiting)} after {timeout_s:g} s; "
                                   f"their flush goes on (see `inmem-ft smp status` on them)")
            time.sleep(POLL_S)
