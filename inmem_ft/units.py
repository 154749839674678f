"""Byte sizes and durations as people write them ("8GiB", "512MB", 1048576; "30m", "2h")."""
import argparse
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{value!r} is not a size; write e.g. 8GiB, 512MiB, 2GB or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size {value!r} must be positive, e.g. 8GiB")
    return n


def argparse_size(value: str) -> int:
    """parse_size for an argparse `type=`: its message, not argparse's "invalid value", reaches the user."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def argparse_duration(value: str) -> float:
    """Seconds from "90", "90s", "30m", "2h" or "7d", for an argparse `type=`."""
    m = _DURATION.match(value)
    if m is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration; write e.g. 90s, 30m, 2h or 7d")
    return float(m[1]) * _SECONDS[m[2]]
