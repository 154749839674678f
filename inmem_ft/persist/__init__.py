"""The persistent tier: flush committed snapshots to disk, atomically, in layouts stock tools can read."""
from .._lazy import exporter

_EXPORTS = {"DiskTier": ".tier", "atomic_write": ".atomic", "atomic_write_text": ".atomic",
            "write_state": ".statefile", "read_state": ".statefile"}
__getattr__ = exporter(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
