"""Crash-safe file writes: a reader sees the old file or the whole new one, never part of one.

Write to a temporary name in the same directory, fsync it, rename it over the final name, fsync the
directory. A crash in between leaves only a `.tmp` file, which nothing reads.
"""
from __future__ import annotations

import os
from typing import Callable

TMP_SUFFIX = ".inmem_ft.tmp"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[object], None]) -> None:
    """Call `write(f)` with a binary file opened on a temporary name, then publish it as `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))
