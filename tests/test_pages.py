"""pages.privatize on a copy-on-write mapping of a shared file, as a restore's views are: the range keeps the
bytes it showed and its addresses once the file is rewritten, whether its whole pages were moved in on huge
pages (a long range) or copied by the kernel (its edge pages, a short range); the bytes beyond it still
show the file."""
import mmap
import os

import numpy as np
import pytest

from inmem_ft import pages

SIZE = 12 << 20


@pytest.fixture
def cow(tmp_path):
    path = tmp_path / "slot"
    with open(path, "wb") as f:
        f.write(np.arange(SIZE // 4, dtype=np.uint32).tobytes())
    fd = os.open(path, os.O_RDWR)
    shared = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
    private = mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    yield shared, private
    private.close()
    shared.close()


@pytest.mark.parametrize("start,length", [(12_345, 9 << 20), (4096, 8 << 20), (100, 5_000)],
                         ids=["unaligned-long", "aligned-long", "short"])
def test_privatized_range_keeps_its_bytes_when_the_file_is_rewritten(cow, start, length):
    shared, private = cow
    view = np.frombuffer(private, dtype=np.uint8)
    before = view.copy()
    address = view.ctypes.data
    view[start + 7] ^= 0xFF  # a byte this process wrote before: privatizing keeps it too
    pages.privatize(address + start, length)
    shared[:] = b"\x7f" * SIZE  # the SMP rewrites the slot
    assert view.ctypes.data == address
    kept = before[start: start + length].copy()
    kept[7] ^= 0xFF
    assert np.array_equal(view[start: start + length], kept)
    page = mmap.PAGESIZE
    # Beyond the range's pages the mapping still shows the file.
    outside = -(-(start + length) // page) * page
    assert (view[outside:] == 0x7F).all()
    assert (view[: start - start % page] == 0x7F).all()
    del view
