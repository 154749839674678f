"""The MAC over every SMP-to-SMP payload: AES-256-GMAC (AES-GCM over the payload as associated data, with
nothing encrypted), from `cryptography` (PyCA, on OpenSSL).

Chosen by measurement (benchmarks/ec_throughput.py, its MAC rows, 64 and 256 MiB, on the 2-core CI box):
GMAC took 0.7-0.9 times as long as RS(4,2) encoding of the same bytes, keyed BLAKE3 (the `blake3` package)
3.4 times and hashlib.blake2b(key=...) 17 times. GMAC runs on the AES and carry-less multiply instructions
(AES-NI/VAES and PCLMULQDQ on x86, the crypto extensions on Arm) that GPU servers have. Like the others it
releases the GIL while it hashes (checked with cryptography 50), so the pulls of several peers are
authenticated side by side with each other and with encoding; the transport feeds it a payload piece by
piece as it sends or receives it, while each piece is still in cache.

GMAC must never see one nonce twice under one key. Each key lives for one connection (it derives from both
ends' fresh handshake nonces), and a message's nonce is its direction and sequence number on that
connection, which never repeat there.
"""
from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_SIZE = 32
TAG_SIZE = 16
_DIRECTIONS = {"c2s": b"c2s\0", "s2c": b"s2c\0"}  # 4 bytes each, then an 8-byte sequence number: 96 bits


class PayloadMAC:
    """The tag of one payload: update() with its bytes in order, then digest()."""

    def __init__(self, key: bytes, direction: str, seq: int):
        nonce = _DIRECTIONS[direction] + seq.to_bytes(8, "big")
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

    def update(self, piece) -> None:
        self._gcm.authenticate_additional_data(piece)

    def digest(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag
