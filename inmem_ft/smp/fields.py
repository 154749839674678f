"""Typed fields of a control request. Whatever a socket sends, an operation sees only integers in range:
a negative rank would name a segment adoption cannot parse, a NaN or a 2**70 step cannot be packed into a
slot header, and a string "5" is not a rank. A bad field raises ValueError, answered with `bad_request`."""
from __future__ import annotations

MAX_RANK = (1 << 24) - 1
MAX_NODE = (1 << 24) - 1
MAX_STEP = (1 << 63) - 1  # a slot header packs the step as a signed 64-bit integer
MAX_BYTES = 1 << 50  # any length or offset; the memory budget refuses far less


def integer(msg: dict, key: str, hi: int, *, optional: bool = False) -> int | None:
    """msg[key] as an int in [0, hi]; None when optional and absent or null."""
    value = msg.get(key)
    if value is None and optional:
        return None
    if type(value) is not int:  # bool is an int subclass, float and str are not ints
        raise ValueError(f"field {key!r} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= hi:
        raise ValueError(f"field {key!r} = {value} is out of range [0, {hi}]")
    return value


def rank(msg: dict, key: str = "rank") -> int:
    return integer(msg, key, MAX_RANK)


def step(msg: dict, key: str = "step", *, optional: bool = False) -> int | None:
    return integer(msg, key, MAX_STEP, optional=optional)


def size(msg: dict, key: str) -> int:
    return integer(msg, key, MAX_BYTES)


def text(msg: dict, key: str, most: int = 1024) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or len(value) > most:
        raise ValueError(f"field {key!r} must be a string of at most {most} characters")
    return value
