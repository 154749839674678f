"""Which SMP serves a job's node: a lock file beside its segments, flock'ed for the SMP's whole life.

The kernel drops an flock when its holder dies, kill -9 included, so "is some SMP serving job J node N?"
has an answer that needs no socket path (sockets live under a runtime directory each launcher may set
differently) and cannot be fooled by a dead SMP's leftovers. A second SMP for the same node is refused,
and cleaning a node's segments holds the lock, so no SMP can start and adopt them half-removed.
"""
from __future__ import annotations

import fcntl
import os
import time

from ..errors import SMPUnavailable
from . import paths
from .segments import check_owned, open_owned, path_of


class NodeLock:
    def __init__(self, job: str, node: int, fd: int):
        self.job, self.node, self._fd = job, node, fd

    @classmethod
    def try_acquire(cls, job: str, node: int) -> "NodeLock | None":
        """The lock, or None when a live process holds it."""
        name = paths.lock_name(job, node)
        while True:
            fd = open_owned(name, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            # The holder we waited out may have unlinked the file before letting go: a lock on that inode
            # guards nothing, so take the file now under the name.
            try:
                same = os.stat(path_of(name)).st_ino == check_owned(fd, name).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return cls(job, node, fd)
            os.close(fd)

    @classmethod
    def acquire(cls, job: str, node: int, wait_s: float = 2.0) -> "NodeLock":
        """For the SMP's life. Waits `wait_s` for a moment's holder (a `status` probing it, a clean)."""
        deadline = time.monotonic() + wait_s
        while (lock := cls.try_acquire(job, node)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if lock is None:
            pid = holder(job, node)
            raise SMPUnavailable(f"another SMP (pid {pid if pid is not None else '?'}) already serves job {job} "
                                 f"node {node}; stop it first (`inmem-ft smp stop --job {job} --node {node}`)")
        os.ftruncate(lock._fd, 0)
        os.pwrite(lock._fd, str(os.getpid()).encode(), 0)
        return lock

    def release(self) -> None:
        """Unlink, then unlock: whoever locks the name next gets a fresh file (see try_acquire)."""
        try:
            os.unlink(path_of(paths.lock_name(self.job, self.node)))
        except FileNotFoundError:
            pass
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def holder(job: str, node: int) -> int | None:
    """The pid of the SMP that serves job `job` node `node` (0 if its pid is not written yet), None if none
    does. A probe only: it creates and removes nothing."""
    try:
        fd = open_owned(paths.lock_name(job, node), os.O_RDONLY)
    except FileNotFoundError:
        return None  # a running SMP keeps its lock file until it exits
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        raw = os.pread(fd, 32, 0)
        return int(raw) if raw.isdigit() else 0
    finally:
        os.close(fd)
