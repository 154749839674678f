"""A background thread started ahead of its work.

threading.Thread.start() returns only once the new thread runs, and a new thread needs a core and the
process's address-space lock (its stack is an mmap). Started right after a framework's load, while the
rank's own background work (checksums, pages made private) and its neighbours' already fill every core and
hold that lock, a start was measured taking 5-200 ms of the restore. Started before the load, at a quiet
moment, it costs well under a millisecond, and handing it its work later is an Event.
"""
from __future__ import annotations

import threading
from typing import Callable


class Armed:
    """A daemon thread, started now, that runs the function given to go() (None: ends without running)."""

    def __init__(self, name: str):
        self._go = threading.Event()
        self._fn: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.wait()
        if self._fn is not None:
            self._fn()

    def go(self, fn: Callable[[], None] | None) -> None:
        if not self._go.is_set():
            self._fn = fn
            self._go.set()

    def join(self) -> None:
        self._thread.join()
