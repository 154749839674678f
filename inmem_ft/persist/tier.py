"""The disk tier the Snapshotter drives from its commit thread.

Framework-free: which files a step becomes is the adapter's business (a `writer` callback); this class
only decides which snapshots are flushed and publishes the `latest` pointer last, atomically, so a
crash mid-flush leaves the previous `latest` and some temporary files, never a half checkpoint.
"""
from __future__ import annotations

import os
from typing import Callable

from .atomic import atomic_write_text

LATEST = "latest"


class DiskTier:
    """Flush every `every`-th snapshot (counted in snapshot intervals) into `directory`.

    writer(step, state) writes this rank's files of the step (atomically, each); it runs on every rank.
    name(step) is the text `latest` points at once every rank has written (e.g. "global_step120").
    """

    def __init__(self, directory: str, every: int, interval: int, writer: Callable[[int, object], None],
                 name: Callable[[int], str] = lambda step: f"global_step{step}"):
        if every < 1:
            raise ValueError("a disk tier needs every >= 1")
        self.directory, self.every, self.interval = directory, every, interval
        self.writer, self.name = writer, name

    def due(self, step: int) -> bool:
        # A function of the step alone, so every rank (and every restart) makes the same choice.
        return step % (self.interval * self.every) == 0

    def write(self, step: int, state) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self.writer(step, state)

    def publish(self, step: int) -> None:
        """Called on one rank after every rank's write() succeeded."""
        atomic_write_text(os.path.join(self.directory, LATEST), self.name(step))

    def latest(self) -> str | None:
        path = os.path.join(self.directory, LATEST)
        try:
            with open(path) as f:
                return f.read().strip() or None
        except FileNotFoundError:
            return None
