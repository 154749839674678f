"""SMP-to-SMP messages over TCP, authenticated with the job's shared secret.

Handshake (mutual HMAC-SHA256 challenge-response, bound to both node ids): the server sends a random nonce
Ns and its node id S; the client answers with its node id C, the node T it means to reach (its --peers
entry), its own nonce Nc and HMAC(secret, "client"|job|C|T|Ns|Nc); the server checks it (else logs
event=refused and hangs up) and proves itself with HMAC(secret, "server"|job|S|C|Ns|Nc). The client checks
that proof and that S is T: an address that --peers gives to the wrong node is an error naming both ids,
not a silent conversation with the wrong SMP. Both derive a session key HMAC(secret, "session"|Ns|Nc), so a
recorded session cannot be replayed. A peer that has not finished the handshake within HANDSHAKE_S is
dropped.

Every message is then: 4-byte length, a JSON header, HMAC(session key, direction|sequence|header), and,
when the header's `n` is not 0, `n` raw payload bytes followed by their MAC (AES-GMAC, cluster/mac.py) under
a key derived from the session key, with direction and sequence as its nonce. A flipped byte anywhere is
refused (event=refused) and the connection dropped. Nothing is ever unpickled.
"""
from __future__ import annotations

import errno
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

from ..errors import ConfigError, InmemFTError
from ..smp import protocol
from . import mac

log = logging.getLogger("inmem_ft.transport")
_LEN_SIZE = 4  # protocol.frame's length prefix; the MAC covers the JSON after it
_MAC = 32
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 32
PIECE = 1 << 20  # bytes per token-bucket grant and per MAC update: the cap is smooth, the piece still in cache
HANDSHAKE_S = 5.0  # a connection that has not authenticated by then is dropped
# A peer cut off by the network sends nothing back: no reset, no FIN. Without these bounds a connect waits for
# the kernel's SYN retries (about two minutes) and a kept-open link until the reply timeout.
CONNECT_S = 5.0  # a connect not answered by then: the peer's host is down or cut off
SILENT_S = 10.0  # bytes sent and not acknowledged, or keepalives unanswered, this long: the peer is gone
QUIET_S = 5.0  # a peer that timed out is not dialled again for this long: each call would wait CONNECT_S anew


class PeerUnavailable(InmemFTError):
    """A peer SMP cannot be reached or stopped answering."""


class PeerRefused(PeerUnavailable):
    """A peer answered but refused the request; `code` names the error class it raised."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class AuthError(InmemFTError):
    """A peer failed the handshake or a message failed its MAC or checksum."""


class PeerMismatch(AuthError):
    """A peer knows the job secret but is another node than the one --peers gives its address to."""


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
        self._payload_key = _mac(key, "payload")
        self._out, self._in = ("c2s", "s2c") if is_client else ("s2c", "c2s")
        self._sent = self._received = 0

    def send(self, header: dict, pieces=()) -> None:
        views = [memoryview(p).cast("B") for p in pieces]
        n, seq = sum(len(v) for v in views), self._sent
        framed = protocol.frame({**header, "n": n})
        self.sock.sendall(framed + _mac(self.key, self._out, seq, framed[_LEN_SIZE:]))
        self._sent += 1
        if not n:
            return
        tag = mac.PayloadMAC(self._payload_key, self._out, seq)
        for v in views:
            for off in range(0, len(v), PIECE):
                piece = v[off: off + PIECE]
                self.bucket.take(len(piece))
                tag.update(piece)
                self.sock.sendall(piece)
        self.sock.sendall(tag.digest())

    def recv(self, into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        header, raw = protocol.recv_raw(self.sock, MAX_HEADER)
        seq = self._received
        if not hmac.compare_digest(protocol.recv_exact(self.sock, _MAC), _mac(self.key, self._in, seq, raw)):
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
        if not n:
            return header, payload
        tag = mac.PayloadMAC(self._payload_key, self._in, seq)
        view = memoryview(payload).cast("B")
        for off in range(0, n, PIECE):
            piece = view[off: off + PIECE]
            protocol.recv_into(self.sock, piece)
            tag.update(piece)
        if not hmac.compare_digest(protocol.recv_exact(self.sock, mac.TAG_SIZE), tag.digest()):
            raise AuthError(f"payload of {n} bytes fails its MAC: tampered with in transit, or sent without this "
                            f"session's key")
        return header, payload


def client_handshake(sock, secret: bytes, job: str, node: int, peer: int, where: str,
                     bucket: TokenBucket) -> Channel:
    """As node `node`, authenticate to the SMP that --peers says is node `peer` (at `where`)."""
    hello = protocol.recv_raw(sock, MAX_HEADER)[0]
    ns, nc = bytes.fromhex(hello["nonce"]), secrets.token_bytes(32)
    sock.sendall(protocol.frame({"job": job, "node": node, "to": peer, "nonce": nc.hex(),
                                 "mac": _mac(secret, "client", job, node, peer, ns, nc).hex()}))
    try:
        reply = protocol.recv_raw(sock, MAX_HEADER)[0]
    except (PeerUnavailable, OSError):
        raise AuthError("the peer hung up during the handshake: it refused our credentials (is INMEM_FT_SECRET the "
                        "same on every node, and is this the same job?)") from None
    server = reply.get("node")
    if type(server) is not int or not hmac.compare_digest(bytes.fromhex(reply.get("mac", "")),
                                                          _mac(secret, "server", job, server, node, ns, nc)):
        raise AuthError("the peer failed to prove it knows the job secret: refusing it")
    if server != peer:
        raise PeerMismatch(f"the SMP at {where} is node {server} of job {job}, but node {node}'s --peers gives that "
                           f"address to node {peer}: start every SMP with the same --peers, listing each node's "
                           f"own address (NODE=HOST:PORT)")
    return Channel(sock, _mac(secret, "session", ns, nc), True, bucket)


def server_handshake(sock, secret: bytes, job: str, node: int, bucket: TokenBucket) -> tuple[Channel, int]:
    ns = secrets.token_bytes(32)
    sock.sendall(protocol.frame({"nonce": ns.hex(), "node": node}))
    hello = protocol.recv_raw(sock, MAX_HEADER)[0]
    nc, client, to = bytes.fromhex(hello["nonce"]), int(hello["node"]), int(hello["to"])
    if hello.get("job") != job or not hmac.compare_digest(bytes.fromhex(hello.get("mac", "")),
                                                          _mac(secret, "client", job, client, to, ns, nc)):
        raise AuthError(f"client claiming node {client} of job {hello.get('job')!r} failed authentication")
    # The proof goes out either way: a client that reached the wrong node can then say so with certainty.
    sock.sendall(protocol.frame({"node": node, "mac": _mac(secret, "server", job, node, client, ns, nc).hex()}))
    if to != node:
        raise PeerMismatch(f"node {client} reached this SMP as node {to}, but it is node {node}: node {client}'s "
                           f"--peers gives this address to the wrong node")
    return Channel(sock, _mac(secret, "session", ns, nc), False, bucket), client


def watch_liveness(sock) -> None:
    """Let the kernel end a link whose peer went silent within about SILENT_S (TCP_USER_TIMEOUT bounds unacknowledged
    bytes; keepalives probe a link that waits for a reply), while a slow peer that still acknowledges keeps it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(SILENT_S // 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(SILENT_S * 1000))


def _drop(sock, late: threading.Event) -> None:
    late.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)  # the handshake's read returns at once
    except OSError:
        pass  # closed meanwhile


class _TCPServer(socketserver.ThreadingTCPServer):
    # SO_REUSEADDR: an SMP restarted on its port binds at once, though connections of the one before may
    # linger in TIME_WAIT; a port another process listens on still fails (EADDRINUSE).
    allow_reuse_address = True


class PeerServer:
    """Accepts authenticated peers; `handler(node, header, payload) -> (reply header, reply pieces)`."""

    def __init__(self, host: str, port: int, secret: bytes, job: str, node: int, handler, bucket: TokenBucket):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                watch_liveness(self.request)
                peer = "%s:%d" % self.request.getpeername()[:2]
                # A bound on the whole handshake, not on each read: a peer trickling bytes is dropped too.
                late = threading.Event()
                timer = threading.Timer(HANDSHAKE_S, _drop, [self.request, late])
                timer.daemon = True
                timer.start()
                try:
                    channel, from_node = server_handshake(self.request, secret, job, node, bucket)
                except (AuthError, KeyError, ValueError, TypeError, OSError) as e:
                    why = f"no valid handshake within {HANDSHAKE_S:.0f} s" if late.is_set() else e
                    log.warning("transport node=%d event=refused peer=%s reason=%s: dropped", node, peer, why)
                    return
                finally:
                    timer.cancel()
                self.request.settimeout(3600)  # an idle peer; one that vanished is ended by watch_liveness
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

        try:
            self.server = _TCPServer((host, port), Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"peer port {host}:{port} of node {node} is in use by another process (`ss -ltnp "
                                  f"'sport = :{port}'` names it): stop that process, or give node {node} another "
                                  f"port in --peers") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"peer address {host}:{port} of node {node} is not an address of this host: "
                                  f"check node {node}'s entry in --peers") from None
            raise
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
        self._timed_out: tuple[float, str] | None = None  # (monotonic time, why) of the last timeout
        self.state = "unknown"  # "up" or "down": how the last call went (`smp status`, the metrics)

    def call(self, header: dict, pieces=(), into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        with self._lock:
            if self._timed_out and time.monotonic() - self._timed_out[0] < QUIET_S:
                raise PeerUnavailable(f"{self._timed_out[1]} ({time.monotonic() - self._timed_out[0]:.1f} s ago; "
                                      f"not dialled again until {QUIET_S:.0f} s after that)")
            self._timed_out = None
            # A kept-open connection may have died with a peer that was since replaced, or cut off meanwhile:
            # retry once, fresh (every peer operation only reads, so repeating one is harmless). Not when this
            # attempt itself waited: a silent peer would only be waited for twice.
            retries = 1 if self._channel is not None else 0
            for attempt in range(retries + 1):
                began = time.monotonic()
                try:
                    if self._channel is None:
                        sock = socket.create_connection(self.addr, timeout=CONNECT_S)
                        sock.settimeout(self.timeout_s)
                        watch_liveness(sock)
                        try:
                            self._channel = client_handshake(sock, self.secret, self.job, self.node, self.peer,
                                                             "%s:%d" % self.addr, self.bucket)
                        except BaseException:
                            sock.close()
                            raise
                    self._channel.send(header, pieces)
                    reply, payload = self._channel.recv(into)
                    break
                except (OSError, PeerUnavailable, ValueError, KeyError, TypeError) as e:
                    self._close_locked()
                    if attempt < retries and time.monotonic() - began < CONNECT_S:
                        continue
                    why = f"peer node {self.peer} at {self.addr[0]}:{self.addr[1]} {_why_unreachable(e, self.timeout_s)}"
                    if isinstance(e, TimeoutError):
                        self._timed_out = (time.monotonic(), why)
                    self.state = "down"
                    raise PeerUnavailable(why) from None
                except AuthError as e:
                    self._close_locked()
                    self.state = "down"
                    log.warning("transport node=%d event=refused peer=%d addr=%s:%d reason=%s", self.node,
                                self.peer, *self.addr, e)
                    raise
        self.state = "up"  # it answered, also when it refused the request
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


def _why_unreachable(e: Exception, reply_s: float) -> str:
    if not isinstance(e, TimeoutError):
        return f"is unreachable or stopped answering ({e})"
    if e.errno is None:  # the socket's own timeout: on connect, or a live peer that sent no reply
        return (f"did not answer within {CONNECT_S:.0f} s (connect) or {reply_s:.0f} s (reply): its host is down, "
                f"cut off from this node, or overloaded")
    return (f"went silent: the link sent no acknowledgement for {SILENT_S:.0f} s (its host is down or cut off from "
            f"this node)")
