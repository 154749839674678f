"""The trainer's side of the SMP control socket."""
from __future__ import annotations

import json
import socket
import threading

import numpy as np

from ..errors import BudgetExceeded, InmemFTError, SMPUnavailable, SnapshotCorrupt, SnapshotLost, UnknownFormat
from . import protocol

_ERRORS = {"budget": BudgetExceeded, "corrupt": SnapshotCorrupt, "lost": SnapshotLost, "format": UnknownFormat}


class SMPClient:
    def __init__(self, socket_path: str, timeout_s: float = 60.0):
        self.socket_path, self.timeout_s = socket_path, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the training thread calls (a first begin, restore) beside the commit thread

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            raise SMPUnavailable(
                f"no SMP is listening on {self.socket_path} ({e.strerror or e}); start the node's daemon with "
                f"`inmem-ft smp start --job <job> --node <node> --memory-budget <size>` or launch through "
                f"the script `inmem-ft launch-script torchrun` prints") from None
        return sock

    def call(self, op: str, **fields) -> dict:
        return self._call(op, fields)[0]

    def _call(self, op: str, fields: dict, into: np.ndarray | None = None) -> tuple[dict, np.ndarray | None]:
        """(reply, the raw bytes sent after it: into `into` when given, else a new array; None if none)."""
        with self._lock:
            if self._sock is None:
                self._sock = self._connect()
            try:
                protocol.send(self._sock, {"op": op, **fields})
                reply = protocol.recv(self._sock)
                payload = None
                if "n" in reply:
                    n = protocol.payload_length(reply)
                    if into is not None and into.nbytes != n:
                        raise protocol.ProtocolError(f"reply carries {n} bytes, {into.nbytes} were asked for")
                    payload = np.empty(n, dtype=np.uint8) if into is None else into
                    protocol.recv_into(self._sock, memoryview(payload).cast("B"))
            except (OSError, protocol.ProtocolError) as e:
                self._close_locked()
                raise SMPUnavailable(f"the SMP on {self.socket_path} stopped answering during '{op}' ({e}); "
                                     f"it may have died: check its log, then `inmem-ft smp start` it again "
                                     f"(a restarted SMP re-adopts the snapshots still in /dev/shm)") from None
        if not reply.pop("ok", False):
            raise _ERRORS.get(reply.get("code"), InmemFTError)(reply.get("error", "SMP refused the request"))
        return reply, payload

    # ---- the job's slots on every node (served by this node's SMP, which asks its peers) ----------------
    def catalog(self, step: int | None = None) -> dict:
        """Every node's committed slots (of `step`, default every step held): {"entries": [{node, rank, step,
        segment, data_off, data_len, manifest_len, source: "memory"|"parity", manifest: dict}], "unreachable":
        [{node, error}]}. Feed it to inmem_ft.snapshot.catalog.fragments."""
        reply, raw = self._call("catalog", {"step": step})
        pos, view = 0, memoryview(raw if raw is not None else b"")
        for entry in reply["entries"]:
            entry["manifest"] = json.loads(bytes(view[pos: pos + entry["manifest_len"]]))
            pos += entry["manifest_len"]
        return {"entries": reply["entries"], "unreachable": reply["unreachable"]}

    def read(self, node: int, rank: int, step: int, offset: int, length: int,
             into: np.ndarray | None = None) -> tuple[np.ndarray, str]:
        """Bytes [offset, offset+length) of node `node`'s committed slot of `rank` at `step` (slot offsets: a
        catalog row's slot_offset), checksum-verified, fetched in pieces of at most protocol.READ_MAX bytes.
        Returns (`into`, or a new uint8 array; "memory" | "parity": parity if any piece was decoded from it)."""
        out = np.empty(length, dtype=np.uint8) if into is None else into.reshape(-1).view(np.uint8)
        if out.nbytes != length:
            raise ValueError(f"`into` holds {out.nbytes} bytes, the read asks for {length}")
        source = "memory"
        for a in range(0, length, protocol.READ_MAX):
            n = min(protocol.READ_MAX, length - a)
            reply, _ = self._call("read", {"node": node, "rank": rank, "step": step, "offset": offset + a,
                                           "length": n}, into=out[a: a + n])
            source = "parity" if reply["source"] == "parity" else source
        return (out if into is None else into), source

    def pull(self, rank: int) -> list[dict]:
        """Install `rank`'s newest committed slots held on other nodes (or decoded from parity) as local slots
        of this SMP, for a rank that now runs here: [{segment, step, source, from_node}], newest first (empty
        when no other node holds a step this node lacks). Then `list` and restore as usual."""
        return self.call("pull", rank=rank)["slots"]

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
