"""This SMP's authenticated links to the other SMPs of the job: one server, one client per peer, and the table
of peer operations the rest of the SMP registers (erasure coding for its group, slot reads for anyone).

It runs whenever the SMP is given --peers, with or without parity. Calls to this node itself go through the
same handlers without a socket, so code that asks "every node" needs no special case for its own.
"""
from __future__ import annotations

import numpy as np

from ..errors import InmemFTError, SnapshotCorrupt, SnapshotLost, UnknownFormat
from .transport import PeerClient, PeerRefused, PeerServer, PeerUnavailable, TokenBucket

# Errors a peer raised that keep their meaning here; any other refusal is a plain InmemFTError.
_ERRORS = {cls.__name__: cls for cls in (SnapshotCorrupt, SnapshotLost, UnknownFormat)}


class Peers:
    def __init__(self, node: int, job: str, addresses: dict[int, tuple[str, int]], secret: bytes | None = None,
                 bandwidth: float | None = None):
        """`addresses`: node -> (host, port) of every SMP of the job, this one included; empty: no network
        (a single node, or an SMP started without --peers)."""
        self.node, self.addresses = node, dict(addresses)
        self._ops: dict[str, tuple] = {}
        self.clients: dict[int, PeerClient] = {}
        self.server = None
        if self.addresses:
            if node not in self.addresses:
                raise ValueError(f"--peers has no address for this node ({node}): list every node as "
                                 f"NODE=HOST:PORT, this one included")
            if not secret:
                raise ValueError("--peers needs the job secret (INMEM_FT_SECRET or --secret-file)")
            bucket = TokenBucket(bandwidth)
            self.clients = {n: PeerClient(n, addr, secret, job, node, bucket)
                            for n, addr in sorted(self.addresses.items()) if n != node}
            self.server = PeerServer(*self.addresses[node], secret, job, node, self._serve, bucket)

    @property
    def nodes(self) -> list[int]:
        """Every node of the job this SMP knows of, itself included."""
        return sorted(self.addresses) or [self.node]

    def links(self) -> list[dict]:
        """Each peer node, its address and how the last call to it went: "up", "down", or "unknown" (not yet
        called)."""
        return [{"node": n, "addr": "%s:%d" % c.addr, "state": c.state} for n, c in sorted(self.clients.items())]

    def register(self, op: str, handler, members=None) -> None:
        """Serve `op` with `handler(peer, header, payload) -> (reply, pieces)`; `members() -> set`: the only
        nodes allowed to ask (the EC groups this node shares, which change when the job shrinks or grows), None
        for any node holding the job secret."""
        if op in self._ops:
            raise ValueError(f"peer operation {op!r} is registered twice")
        self._ops[op] = (handler, members)

    def start(self) -> None:
        if self.server is not None:
            self.server.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for client in self.clients.values():
            client.close()

    def _serve(self, peer: int, header: dict, payload):
        op = header.get("op")
        handler, members = self._ops.get(op, (None, None))
        if handler is None:
            raise InmemFTError(f"unknown peer operation {op!r}")
        allowed = members() if members is not None else None
        if allowed is not None and peer not in allowed and peer != self.node:
            raise InmemFTError(f"node {peer} may not ask {op!r}: it shares no EC group with this node "
                               f"(nodes {sorted(allowed)} do)")
        try:
            return handler(peer, header, payload)
        except (KeyError, TypeError, ValueError) as e:
            raise InmemFTError(f"malformed {op!r} request: {e}") from None

    def call(self, node: int, header: dict, into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        """Ask `node`: (reply, payload bytes). Raises PeerUnavailable when it cannot be reached, the error it
        raised when it refused (SnapshotCorrupt, SnapshotLost, ...; InmemFTError otherwise)."""
        if node == self.node:
            reply, pieces = self._serve(node, header, None)
            return dict(reply), _gather(pieces, into)
        client = self.clients.get(node)
        if client is None:
            raise PeerUnavailable(f"node {node} has no address: start the SMPs with --peers listing every node")
        try:
            return client.call(header, into=into)
        except PeerRefused as e:
            raise _ERRORS.get(e.code, InmemFTError)(str(e)) from None


def _gather(pieces, into: np.ndarray | None) -> np.ndarray:
    views = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in pieces]
    n = sum(v.nbytes for v in views)
    if into is None:
        into = np.empty(n, dtype=np.uint8)
    elif into.nbytes != n:
        raise InmemFTError(f"local answer has {n} bytes, the caller expected {into.nbytes}")
    pos = 0
    for v in views:
        into[pos: pos + v.nbytes] = v
        pos += v.nbytes
    return into
