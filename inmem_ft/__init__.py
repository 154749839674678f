"""inmem_ft: in-memory, erasure-coded snapshots of training state that survive trainer and node failures."""
from .capture import Snapshotter, capture_rng_state, restore_rng_state
from .config import SnapshotConfig
from .errors import (BudgetExceeded, ConfigError, InmemFTError, LayoutMismatch, SMPUnavailable,
                     SnapshotCorrupt, UnsafeType)
from .snapshot import Fragment, Replicated, Sharded, register_safe_class

__version__ = "0.1.0"
__all__ = ["Snapshotter", "SnapshotConfig", "capture_rng_state", "restore_rng_state", "Fragment", "Replicated",
           "Sharded", "register_safe_class", "InmemFTError", "ConfigError", "SMPUnavailable", "BudgetExceeded",
           "SnapshotCorrupt", "LayoutMismatch", "UnsafeType"]
