"""inmem_ft: in-memory, erasure-coded snapshots of training state that survive trainer and node failures."""
from ._lazy import exporter
from .errors import (BudgetExceeded, ConfigError, InmemFTError, LayoutMismatch, SMPUnavailable,
                     SnapshotCorrupt, SnapshotLost, UnknownFormat, UnsafeType)

__version__ = "0.1.0"
_EXPORTS = {"Snapshotter": ".capture", "capture_rng_state": ".capture", "restore_rng_state": ".capture",
            "SnapshotConfig": ".config", "ShardSpec": ".snapshot", "Topology": ".snapshot", "Replicated": ".snapshot",
            "Sharded": ".snapshot", "register_safe_class": ".snapshot", "report_loss": ".telemetry",
            "log_to_stderr": ".telemetry", "status": ".smp.control"}
__getattr__ = exporter(__name__, _EXPORTS)
__all__ = [*_EXPORTS, "InmemFTError", "ConfigError", "SMPUnavailable", "BudgetExceeded", "SnapshotCorrupt",
           "SnapshotLost", "LayoutMismatch", "UnknownFormat", "UnsafeType"]
