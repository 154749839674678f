"""A committed snapshot's numbers as (name, value, step) events for a framework's own metric writers
(DeepSpeed's monitor: TensorBoard, W&B, CSV; Megatron's TensorBoard and W&B writers), read on the training
thread, where those writers are used."""
from __future__ import annotations

# Seconds the training thread was held by the snapshot (its copy out of device memory, and any wait for it at
# the next fence), seconds its commit took behind training, and the bytes it holds.
NAMES = {"stall_s": "inmem_ft/snapshot_stall_s", "commit_s": "inmem_ft/snapshot_commit_s",
         "bytes": "inmem_ft/snapshot_bytes"}


class Unreported:
    """The newest committed snapshot of a Snapshotter that the writers were not told of yet."""

    def __init__(self, metrics):
        self.metrics, self._seen = metrics, metrics.snapshots

    def events(self) -> list[tuple[str, float, int]]:
        m, last = self.metrics, self.metrics.last_committed
        if m.snapshots == self._seen or last is None:
            return []
        self._seen = m.snapshots
        return [(name, last[key], last["step"]) for key, name in NAMES.items()]
