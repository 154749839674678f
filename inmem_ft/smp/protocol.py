"""Length-prefixed JSON framing, shared by the SMP control socket and the SMP-to-SMP transport: a 4-byte
length, then one JSON object. Never pickle: whatever arrives on a socket is parsed as data only.

A control reply may carry raw bytes after it (a slot read, manifests): the object then says how many in
`n`, and the bytes follow unframed, so they can land straight in the caller's buffer.
"""
from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct(">I")
MAX_MESSAGE = 16 << 20
MAX_PAYLOAD = 256 << 20  # raw bytes after one control reply; bulk reads come in pieces far below this
READ_MAX = 8 << 20  # bytes of slot data per read request (control or peer): what one request may hold


class ProtocolError(ConnectionError):
    pass


class BadMessage(ProtocolError):
    """A message that is not a JSON object of finite values. `framed`: it was read whole, so the connection
    still frames and the next message can be read; otherwise the stream is lost and must be closed."""

    def __init__(self, message: str, framed: bool = True):
        super().__init__(message)
        self.framed = framed


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text} is not finite")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def frame(message: dict) -> bytes:
    raw = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw


def send(sock: socket.socket, message: dict, pieces=()) -> None:
    """Send `message`; with `pieces` (buffers), their total length goes in `n` and their bytes follow."""
    views = [memoryview(p).cast("B") for p in pieces]
    if views:
        message = {**message, "n": sum(len(v) for v in views)}
    sock.sendall(frame(message))
    for v in views:
        sock.sendall(v)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:], min(len(view) - got, 1 << 24))
        if not r:
            raise ProtocolError("connection closed by peer")
        got += r


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_raw(sock: socket.socket, limit: int = MAX_MESSAGE) -> tuple[dict, bytes]:
    """One framed object and its raw JSON bytes (the transport authenticates those)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > limit:
        raise BadMessage(f"message of {n} bytes exceeds the {limit}-byte limit", framed=False)
    raw = recv_exact(sock, n)
    try:
        message = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # bad UTF-8 is a ValueError too; deep nesting a RecursionError
        raise BadMessage(f"message is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise BadMessage(f"message is a JSON {type(message).__name__}, not an object")
    return message, raw


def recv(sock: socket.socket) -> dict:
    return recv_raw(sock)[0]


def payload_length(message: dict, limit: int = MAX_PAYLOAD) -> int:
    n = int(message.get("n", 0))
    if not 0 <= n <= limit:
        raise ProtocolError(f"payload of {n} bytes exceeds the {limit}-byte limit")
    return n
