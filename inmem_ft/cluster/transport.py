"""SMP-to-SMP messages over TCP, authenticated with the job's shared secret.

Handshake (mutual HMAC-SHA256 challenge-response): the server sends a random nonce Ns; the client
answers with its node id, its own nonce Nc and HMAC(secret, "client"|job|node|Ns|Nc); the server checks
it (else logs event=refused and hangs up) and proves itself with HMAC(secret, "server"|job|Ns|Nc). Both
derive a session key HMAC(secret, "session"|Ns|Nc), so a recorded session cannot be replayed.

Every message is then: 4-byte length, a JSON header, HMAC(session key, direction|sequence|header), and
`n` raw payload bytes whose xxh3 is in the header. The MAC binds the payload to the authenticated header
without running SHA over gigabytes; xxh3 runs at memory speed. Nothing is ever unpickled.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import socketserver
import stat
import threading
import time

import numpy as np
import xxhash

from ..errors import InmemFTError
from ..smp import protocol

log = logging.getLogger("inmem_ft.transport")
_LEN_SIZE = 4  # protocol.frame's length prefix; the MAC covers the JSON after it
_MAC = 32
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 32
_SEND_PIECE = 1 << 20  # bytes per token-bucket grant: fine enough that the cap is smooth


class PeerUnavailable(InmemFTError):
    """A peer SMP cannot be reached or stopped answering."""


class PeerRefused(PeerUnavailable):
    """A peer answered but refused the request; `code` names the error class it raised."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class AuthError(InmemFTError):
    """A peer failed the handshake or a message failed its MAC or checksum."""


class SecretError(InmemFTError, ValueError):
    """The job secret is missing, short, or readable by others."""


def load_secret(secret_file: str | None = None) -> bytes:
    """The job secret: from --secret-file (must be 0600, owned by us) or INMEM_FT_SECRET."""
    if secret_file:
        st = os.stat(secret_file)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise SecretError(f"secret file {secret_file} must be owned by uid {os.getuid()} with mode 0600 "
                                       f"(it is uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}); "
                                       f"chmod 600 it")
        with open(secret_file, "rb") as f:
            secret = f.read().strip()
    else:
        secret = os.environ.get("INMEM_FT_SECRET", "").encode()
    if len(secret) < 16:
        raise SecretError("SMP-to-SMP traffic needs a per-job secret of at least 16 bytes: set "
                                   "INMEM_FT_SECRET or pass --secret-file (mode 0600), the same on every node")
    return secret


def parse_peers(spec: str) -> dict[int, tuple[str, int]]:
    """'0=10.0.0.1:29600,1=10.0.0.2:29600' -> {0: ('10.0.0.1', 29600), ...}"""
    peers = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            node, addr = item.split("=", 1)
            host, port = addr.rsplit(":", 1)
            peers[int(node)] = (host, int(port))
        except ValueError:
            raise ValueError(f"peer entry {item!r} is not NODE=HOST:PORT (e.g. 0=10.0.0.1:29600)") from None
    return peers


class TokenBucket:
    """Caps outgoing bulk bytes at `rate` bytes/s (None: no cap), with bursts of up to one second's worth."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._tokens = rate or 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if debt:
            time.sleep(debt)


def _mac(key: bytes, *parts) -> bytes:
    return hmac.new(key, b"|".join(p if isinstance(p, bytes) else str(p).encode() for p in parts),
                    hashlib.sha256).digest()


class Channel:
    """One authenticated connection: send/recv (header, payload) messages with sequence-numbered MACs."""

    def __init__(self, sock, key: bytes, is_client: bool, bucket: TokenBucket):
        self.sock, self.key, self.bucket = sock, key, bucket
        self._out, self._in = ("c2s", "s2c") if is_client else ("s2c", "c2s")
        self._sent = self._received = 0

    def send(self, header: dict, pieces=()) -> None:
        views = [memoryview(p).cast("B") for p in pieces]
        digest = xxhash.xxh3_64()
        for v in views:
            digest.update(v)
        header = {**header, "n": sum(len(v) for v in views), "x": digest.hexdigest()}
        framed = protocol.frame(header)
        self.sock.sendall(framed + _mac(self.key, self._out, self._sent, framed[_LEN_SIZE:]))
        self._sent += 1
        for v in views:
            for off in range(0, len(v), _SEND_PIECE):
                piece = v[off: off + _SEND_PIECE]
                self.bucket.take(len(piece))
                self.sock.sendall(piece)

    def recv(self, into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        header, raw = protocol.recv_raw(self.sock, MAX_HEADER)
        mac = protocol.recv_exact(self.sock, _MAC)
        if not hmac.compare_digest(mac, _mac(self.key, self._in, self._received, raw)):
            raise AuthError("message header fails its HMAC: tampered, replayed or from another session")
        self._received += 1
        n = int(header["n"])
        if n > MAX_PAYLOAD:
            raise AuthError(f"payload of {n} bytes exceeds {MAX_PAYLOAD}")
        if into is not None and n == 0 and header.get("ok") is False:
            return header, np.empty(0, dtype=np.uint8)  # a refusal carries no bytes, whatever was asked for
        if into is not None and into.nbytes != n:
            raise AuthError(f"payload has {n} bytes, the receiver expected {into.nbytes}")
        payload = np.empty(n, dtype=np.uint8) if into is None else into
        protocol.recv_into(self.sock, memoryview(payload).cast("B"))
        if xxhash.xxh3_64_hexdigest(payload) != header["x"]:
            raise AuthError(f"payload of {n} bytes fails its xxh3 checksum: corrupted in transit")
        return header, payload


def client_handshake(sock, secret: bytes, job: str, node: int, bucket: TokenBucket) -> Channel:
    hello = protocol.recv_raw(sock, MAX_HEADER)[0]
    ns, nc = bytes.fromhex(hello["nonce"]), secrets.token_bytes(32)
    sock.sendall(protocol.frame({"job": job, "node": node, "nonce": nc.hex(),
                                 "mac": _mac(secret, "client", job, node, ns, nc).hex()}))
    try:
        reply = protocol.recv_raw(sock, MAX_HEADER)[0]
    except (PeerUnavailable, OSError):
        raise AuthError("the peer hung up during the handshake: it refused our credentials (is INMEM_FT_SECRET the "
                        "same on every node, and is this the same job?)") from None
    if not hmac.compare_digest(bytes.fromhex(reply.get("mac", "")), _mac(secret, "server", job, ns, nc)):
        raise AuthError("the peer failed to prove it knows the job secret: refusing it")
    return Channel(sock, _mac(secret, "session", ns, nc), True, bucket)


def server_handshake(sock, secret: bytes, job: str, bucket: TokenBucket) -> tuple[Channel, int]:
    ns = secrets.token_bytes(32)
    sock.sendall(protocol.frame({"nonce": ns.hex()}))
    hello = protocol.recv_raw(sock, MAX_HEADER)[0]
    nc, node = bytes.fromhex(hello["nonce"]), int(hello["node"])
    if hello.get("job") != job or not hmac.compare_digest(bytes.fromhex(hello.get("mac", "")),
                                                          _mac(secret, "client", job, node, ns, nc)):
        raise AuthError(f"client claiming node {node} of job {hello.get('job')!r} failed authentication")
    sock.sendall(protocol.frame({"mac": _mac(secret, "server", job, ns, nc).hex()}))
    return Channel(sock, _mac(secret, "session", ns, nc), False, bucket), node


class PeerServer:
    """Accepts authenticated peers; `handler(node, header, payload) -> (reply header, reply pieces)`."""

    def __init__(self, host: str, port: int, secret: bytes, job: str, node: int, handler, bucket: TokenBucket):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.request.settimeout(3600)  # a peer that vanished without a FIN
                peer = "%s:%d" % self.request.getpeername()[:2]
                try:
                    channel, from_node = server_handshake(self.request, secret, job, bucket)
                except (AuthError, KeyError, ValueError, TypeError) as e:
                    log.warning("transport node=%d event=refused peer=%s reason=%s", node, peer, e)
                    return
                except (PeerUnavailable, OSError):
                    return
                try:
                    while True:
                        header, payload = channel.recv()
                        try:
                            reply, pieces = handler(from_node, header, payload)
                            reply = {"ok": True, **reply}
                        except InmemFTError as e:
                            reply, pieces = {"ok": False, "error": str(e), "code": type(e).__name__}, ()
                        channel.send(reply, pieces)
                except AuthError as e:
                    log.warning("transport node=%d event=refused peer=%s reason=%s", node, peer, e)
                except (PeerUnavailable, OSError, ValueError, KeyError):
                    pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="inmem_ft-peer-server", daemon=True)

    def start(self) -> "PeerServer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class PeerClient:
    """A connection to one peer SMP, opened on first use and reopened after a failure."""

    def __init__(self, peer: int, addr: tuple[str, int], secret: bytes, job: str, node: int, bucket: TokenBucket,
                 timeout_s: float = 60.0):
        self.peer, self.addr, self.secret, self.job, self.node = peer, addr, secret, job, node
        self.bucket, self.timeout_s = bucket, timeout_s
        self._channel: Channel | None = None
        self._lock = threading.Lock()

    def call(self, header: dict, pieces=(), into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        with self._lock:
            # A kept-open connection may have died with a peer that was since replaced: retry once, fresh
            # (every peer operation only reads, so repeating one is harmless).
            retries = 1 if self._channel is not None else 0
            for attempt in range(retries + 1):
                try:
                    if self._channel is None:
                        sock = socket.create_connection(self.addr, timeout=self.timeout_s)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        try:
                            self._channel = client_handshake(sock, self.secret, self.job, self.node, self.bucket)
                        except BaseException:
                            sock.close()
                            raise
                    self._channel.send(header, pieces)
                    reply, payload = self._channel.recv(into)
                    break
                except (OSError, PeerUnavailable, ValueError, KeyError) as e:
                    self._close_locked()
                    if attempt < retries:
                        continue
                    raise PeerUnavailable(f"peer node {self.peer} at {self.addr[0]}:{self.addr[1]} is unreachable "
                                          f"or stopped answering ({e})") from None
                except AuthError:
                    self._close_locked()
                    raise
        if not reply.pop("ok", False):
            raise PeerRefused(f"peer node {self.peer} refused {header.get('op')!r}: {reply.get('error')}",
                              reply.get("code"))
        return reply, payload

    def _close_locked(self) -> None:
        if self._channel is not None:
            self._channel.sock.close()
            self._channel = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
