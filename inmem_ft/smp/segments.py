"""Named shared-memory segments that outlive the processes using them, in this user's private namespace.

Written on os/mmap rather than multiprocessing.shared_memory because, on Python 3.11, SharedMemory
registers every attach with the resource tracker, which unlinks the segment when a trainer dies (the
opposite of what a crash-surviving snapshot needs), and it cannot preallocate: a tmpfs that runs out
delivers SIGBUS to the writer mid-copy, where posix_fallocate gives a clean ENOSPC at reservation.

Where they live: /dev/shm is world-writable (sticky), so a flat name there can be listed by anyone (job
names, sizes), taken first by another user, or planted for an SMP to adopt. Segments therefore live in a
per-user directory, /dev/shm/inmemft-<uid>, mode 0700: nobody else can list, open or create names in it,
and the sticky bit of /dev/shm keeps anyone else from renaming or replacing the directory once it is ours.
That one check (the directory is a real directory, ours, 0700) makes the whole namespace private, where flat
names would need an owner and mode check on every name we list, plus a retry for every squatted name. Every
open still uses O_NOFOLLOW and checks the file itself (a regular file, ours, no group or other bits): root,
or one of our own processes with a careless umask, can still put something there, and it is refused, never
adopted. POSIX shm_open names cannot hold '/', which is why segments are opened by path, not by shm_open.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat

from .. import pages
from ..errors import ForeignSegment
from ..units import human

# Overridable so that tests can put the segments on a small tmpfs of their own; every process of a node
# (SMP, trainers, the CLI) must see the same value.
SHM_DIR = os.environ.get("INMEM_FT_SHM_DIR", "/dev/shm")


def namespace() -> str:
    """This user's segment directory (not checked: see private_namespace)."""
    return os.path.join(SHM_DIR, f"inmemft-{os.getuid()}")


def private_namespace(create: bool = False) -> str | None:
    """The segment directory, checked: a real directory (not a link), ours, mode 0700. None when it does not
    exist and `create` is off."""
    path = namespace()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "non-directory"
        raise ForeignSegment(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700, but it is a {kind} of uid "
            f"{st.st_uid} with mode {oct(stat.S_IMODE(st.st_mode))}: another user may have planted it to see or "
            f"feed this user's snapshots; remove it (as root if needed) and start the SMP again")
    return path


def path_of(name: str) -> str:
    return os.path.join(namespace(), name)


def check_owned(fd: int, name: str) -> os.stat_result:
    """Refuse a file this user's SMP did not create: another owner, group/other permission bits, not a file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ForeignSegment(
            f"segment {name} is owned by uid {st.st_uid} with mode {oct(stat.S_IMODE(st.st_mode))}, where this "
            f"user's SMP creates files of uid {os.getuid()} with mode 0600: it was planted, not written by an SMP "
            f"of this user; it is refused and left in place (remove it with `inmem-ft smp clean` once you know "
            f"where it came from)")
    return st


def open_owned(name: str, flags: int, mode: int = 0o600) -> int:
    """os.open of a file in the private namespace, never through a link, refused unless it is ours (check_owned)."""
    fd = os.open(os.path.join(private_namespace(create=bool(flags & os.O_CREAT)) or namespace(), name),
                 flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        check_owned(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Segment:
    def __init__(self, name: str, size: int | None = None, *, create: bool = False):
        self.name = name
        try:
            fd = open_owned(name, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0))
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link: a plant, refused like a foreign file
                raise ForeignSegment(f"segment {name} is a symbolic link, not a segment an SMP of this user "
                                     f"created: refused and left in place") from None
            raise
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(path_of(name))
                    if e.errno == errno.ENOSPC:
                        free, total = capacity()
                        raise MemoryError(
                            f"{SHM_DIR} has no room for a {human(size)} snapshot slot ({human(free)} free of "
                            f"{human(total)}): free it (`inmem-ft smp clean` removes stale snapshots), lower the "
                            f"budget, or {how_to_enlarge(total + size)}") from None
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

    def private(self):
        """A copy-on-write mapping of the same memory (an mmap): reads share the segment's pages, the first write
        to a page gives this process its own copy, and the segment never changes through it. Pages not yet
        written still show what the segment holds, so the caller privatizes what it keeps before the segment
        may be rewritten (pages.privatize). The mapping holds the segment's memory while it lives, even once an
        SMP unlinks the segment (a slot replaced by one of another size); slots of a running job are rewritten
        in place, so in practice nothing is held twice."""
        fd = open_owned(self.name, os.O_RDONLY)
        try:
            if os.fstat(fd).st_ino != self.inode:
                raise ForeignSegment(f"segment {self.name} was replaced since it was mapped: refused")
            return mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

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


def read_record(name: str) -> str | None:
    """A small text file of the namespace (one an SMP wrote with write_record); None if there is none."""
    try:
        fd = open_owned(name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        return f.read()


def write_record(name: str, text: str) -> None:
    """Replace a small text file of the namespace in one step: a reader sees the old text or the new."""
    tmp = f"{name}.tmp"
    unlink(tmp)
    with os.fdopen(open_owned(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
        f.write(text)
    os.replace(path_of(tmp), path_of(name))


def names_with_prefix(prefix: str) -> list[str]:
    directory = private_namespace()
    if directory is None:
        return []
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix))


def capacity() -> tuple[int, int]:
    """(free, total) bytes of the file system the segments live on."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def held_bytes(prefix: str) -> int:
    """Bytes the namespace's files of this prefix hold (a node's kept snapshots, which its SMP adopts or reuses)."""
    held = 0
    for name in names_with_prefix(prefix):
        try:
            held += os.lstat(path_of(name)).st_size
        except FileNotFoundError:
            pass  # removed while we looked
    return held


def how_to_enlarge(size: int) -> str:
    """How to give the segments' file system `size` bytes, in the units Docker and Kubernetes take: a container's
    /dev/shm is 64 MiB by default, a pod's is what its emptyDir allows."""
    unit, suffix = (2**30, "g") if size > 2**30 else (2**20, "m")
    count = -(-size // unit)  # rounded up
    docker, kube = f"{count}{suffix}", f"{count}{suffix.upper()}i"
    return (f"give {SHM_DIR} at least {human(count * unit)}: `docker run --shm-size={docker}`, "
            f"on Kubernetes an emptyDir {{medium: Memory, sizeLimit: {kube}}} mounted at {SHM_DIR}, on a host "
            f"`mount -o remount,size={docker} {SHM_DIR}`")
