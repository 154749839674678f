"""Old spellings of renamed settings and words, kept working for one release with one line saying so.

Every rename goes through here, so each old spelling says the same kind of line once per process, on the
`inmem_ft` logger at WARNING: visible with no logging configured (Python's last-resort handler prints it) and
through the application's handlers, once, when it has some.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("inmem_ft.deprecation")
_said: set[str] = set()
STILL_WORKS = "the old spelling still works in this release and stops working in the next"


def deprecated(old: str, new: str, note: str = "") -> None:
    """Say once per process that `old` is renamed `new` (`note`: what changes besides the name)."""
    if old in _said:
        return
    _said.add(old)
    log.warning("deprecated: %s is now %s%s; %s", old, new, f" ({note})" if note else "", STILL_WORKS)


def env(new: str, old: str) -> str | None:
    """$new, else $old (renamed: said once), else None."""
    if os.environ.get(new):
        return os.environ[new]
    if os.environ.get(old):
        deprecated(f"${old}", f"${new}")
        return os.environ[old]
    return None


# Restore sources once written with a space (`Restored.tier`); the log lines always said them with '_'.
OLD_TIERS = {"peer_reconstruction": "peer reconstruction", "memory_resharded": "memory resharded",
             "peer_memory": "peer memory"}


class Tier(str):
    """A restore source as the log line says it (`peer_reconstruction`) that still compares equal to its old
    spelling (`"peer reconstruction"`), saying so, for one release."""

    def __eq__(self, other):
        if isinstance(other, str) and other != str(self) and OLD_TIERS.get(str(self)) == other:
            deprecated(f"the tier {other!r}", f"{str(self)!r}")
            return True
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__
