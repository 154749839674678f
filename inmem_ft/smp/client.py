"""The trainer's side of the SMP control socket."""
from __future__ import annotations

import socket
import threading

from ..errors import BudgetExceeded, InmemFTError, SMPUnavailable, SnapshotCorrupt, SnapshotLost
from . import protocol

_ERRORS = {"budget": BudgetExceeded, "corrupt": SnapshotCorrupt, "lost": SnapshotLost}


class SMPClient:
    def __init__(self, socket_path: str, timeout_s: float = 60.0):
        self.socket_path, self.timeout_s = socket_path, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the trainer thread begins, the commit thread commits

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
                f"launch/torchrun_inmem.sh") from None
        return sock

    def call(self, op: str, **fields) -> dict:
        with self._lock:
            if self._sock is None:
                self._sock = self._connect()
            try:
                protocol.send(self._sock, {"op": op, **fields})
                reply = protocol.recv(self._sock)
            except (OSError, protocol.ProtocolError) as e:
                self._close_locked()
                raise SMPUnavailable(f"the SMP on {self.socket_path} stopped answering during '{op}' ({e}); "
                                     f"it may have died: check its log, then `inmem-ft smp start` it again "
                                     f"(a restarted SMP re-adopts the snapshots still in /dev/shm)") from None
        if not reply.pop("ok", False):
            raise _ERRORS.get(reply.get("code"), InmemFTError)(reply.get("error", "SMP refused the request"))
        return reply

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
