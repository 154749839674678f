"""Crash-safe file writes (the SMP's disk tier, smp/disktier.py, and exports publish files with them)."""
from .._lazy import exporter

_EXPORTS = {"atomic_write": ".atomic", "atomic_write_text": ".atomic"}
__getattr__ = exporter(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
