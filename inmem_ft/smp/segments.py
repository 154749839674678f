"""Named POSIX shared-memory segments in /dev/shm that outlive the processes using them.

Written on os/mmap rather than multiprocessing.shared_memory because, on Python 3.11, SharedMemory
registers every attach with the resource tracker, which unlinks the segment when a trainer dies (the
opposite of what a crash-surviving snapshot needs), and it cannot preallocate: a tmpfs that runs out
delivers SIGBUS to the writer mid-copy, where posix_fallocate gives a clean ENOSPC at reservation.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

from .. import pages

SHM_DIR = "/dev/shm"


def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Segment:
    def __init__(self, name: str, size: int | None = None, *, create: bool = False):
        self.name = name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path_of(name), flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(path_of(name))
                    if e.errno == errno.ENOSPC:
                        raise MemoryError(
                            f"/dev/shm has no room for a {size / 2**30:.2f} GiB snapshot slot; free memory, "
                            f"enlarge /dev/shm (mount -o remount,size=...) or lower the budget") from None
                    raise
            st = os.fstat(fd)
            # The identity of the memory: a restarted SMP may unlink a segment and create another under the
            # same name, and a mapping of the old one then writes into memory nobody reads.
            self.size, self.inode = st.st_size, st.st_ino
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def populate(self) -> None:
        """Prefault the whole mapping, so the first copy into it runs at memcpy speed (this runs in a background
        thread while the training thread works: pages.populate releases the GIL)."""
        anchor = ctypes.c_char.from_buffer(self._mmap)
        address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open; the buffer export must not linger
        pages.populate(address, self.size)

    def close(self) -> None:
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # a tensor still views this memory; the mapping goes when that tensor does

    def unlink(self) -> None:
        unlink(self.name)


def unlink(name: str) -> None:
    try:
        os.unlink(path_of(name))
    except FileNotFoundError:
        pass


def names_with_prefix(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize
