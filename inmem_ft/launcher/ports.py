"""TCP ports for the jobs this machine simulates (peer ports, rendezvous stores, test daemons).

free_port(count) hands out a block of `count` consecutive ports and reserves it machine-wide until the calling
process exits, so that no two jobs get the same port: not two of one process (the test suite), not one of
a subprocess, not one of another checkout's suite running beside it. A port that is free *now* is not enough:
a job's listeners bind later (an SMP once it has started, a store once its rank runs, again after a restart),
and another caller checking meanwhile would see the port free too.

The reservation is a POSIX byte-range lock on byte `port` of one machine-wide file (LOCK_PATH): the kernel
drops it when its process ends, however it ends (SIGKILL too), so nothing stale is left to expire. POSIX
locks do not conflict within one process, so the ports this process holds are also kept in a set.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import threading

LOCK_PATH = "/tmp/inmem_ft-ports.lock"
LOWEST = 10000

_mutex = threading.Lock()
_held: set[int] = set()  # ports this process has handed out (and holds the locks of)
_fd: list[int] = []  # the lock file, open for the life of the process: closing any descriptor of it would
# drop every lock this process holds on it


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports, reserved for this process until it exits: none of them is
    handed out again, here or in any other process that asks here, and each was free when reserved.
    The ports lie below the kernel's ephemeral range: simulated jobs listen on them again after a restart
    (torchrun's store, the SMPs' peer ports), and a port from the ephemeral range may meanwhile be some
    other process's outgoing connection, when the bind fails with EADDRINUSE."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    if ephemeral - count <= LOWEST:
        raise RuntimeError(f"no room for {count} ports between {LOWEST} and the ephemeral range ({ephemeral}-)")
    with _mutex:
        fd = _lock_file()
        for _ in range(100000):
            first = random.randrange(LOWEST, ephemeral - count)
            block = range(first, first + count)
            if _held.intersection(block) or not _lock(fd, first, count):
                continue
            if all(_bindable(port) for port in block):
                _held.update(block)
                return first
            fcntl.lockf(fd, fcntl.LOCK_UN, count, first)  # in use by something outside: leave it
        raise RuntimeError(f"found no {count} free consecutive ports below {ephemeral}")


def _lock_file() -> int:
    if not _fd:
        _fd.append(_open(LOCK_PATH))
    return _fd[0]


def _open(path: str) -> int:
    """The lock file, open for writing (a write lock needs it): shared by every user of the machine, unless
    another user's file cannot be written (then a file of this user's own: users do not see each other's)."""
    for _ in range(10):
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        except PermissionError:
            break
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            os.fchmod(fd, 0o666)  # whatever the umask: every user takes its locks in the same file
            return fd
        except FileExistsError:
            continue  # created meanwhile by another process: open that one
    if path != LOCK_PATH:
        raise PermissionError(errno.EACCES, "cannot open the port lock file for writing", path)
    return _open(f"{path}.{os.getuid()}")


def _lock(fd: int, first: int, count: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, count, first)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False  # another process holds one of them
        raise


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
