"""Framing for the SMP control socket: a 4-byte length, then one JSON object. Never pickle: whatever
arrives on a socket is parsed as data only."""
from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct(">I")
MAX_MESSAGE = 16 << 20


class ProtocolError(ConnectionError):
    pass


def send(sock: socket.socket, message: dict) -> None:
    raw = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ProtocolError("connection closed by peer")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit")
    message = json.loads(_recv_exact(sock, n))
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    return message
