"""Where a node's SMP puts its socket and log, and how its segments are named (every name carries the job id,
checked by check_job, jobid.py's rule)."""
from __future__ import annotations

import os
import re
import stat

from ..jobid import check_job


def runtime_dir() -> str:
    base = os.environ.get("INMEM_FT_RUNTIME_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "inmem_ft") if xdg else f"/tmp/inmem_ft-{os.getuid()}"
    return base


def job_dir(job: str) -> str:
    return os.path.join(runtime_dir(), check_job(job))


def make_private_dir(path: str) -> str:
    """Create the directory owner-only; refuse one another user owns or can write, or a link to one (in a
    sticky /tmp anyone may plant a link where ours would be)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700 "
                              f"(it is uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); fix or remove it")
    return path


def default_socket(job: str, node: int) -> str:
    return os.path.join(job_dir(job), f"node{node}.sock")


def default_log(job: str, node: int) -> str:
    return os.path.join(job_dir(job), f"node{node}.log")


def segment_prefix(job: str, node: int) -> str:
    return f"inmemft.{check_job(job)}.n{node}."


def complete_record_name(job: str, node: int) -> str:
    """The file beside the slots that remembers the newest step the job completed."""
    return f"{segment_prefix(job, node)}complete"


def rebuild_record_name(job: str, node: int) -> str:
    """The file beside the slots that says a rebuild from the EC group is under way, and how far it got."""
    return f"{segment_prefix(job, node)}rebuild"


def trust_record_name(job: str, node: int) -> str:
    """The file beside the slots that remembers the steps found bad."""
    return f"{segment_prefix(job, node)}trust"


def lock_name(job: str, node: int) -> str:
    """The file beside the slots that the node's running SMP holds locked (smp/nodelock.py)."""
    return f"{segment_prefix(job, node)}lock"


_OWNER = re.compile(r"^inmemft\.([A-Za-z0-9_-]{1,64})\.n(\d+)\.")


def owner_of(name: str) -> tuple[str, int] | None:
    """(job, node) of any file an SMP keeps in shared memory (slots, parity, records), from its name."""
    m = _OWNER.match(name)
    return (m[1], int(m[2])) if m else None


def segment_name(job: str, node: int, rank: int, slot: int, generation: int) -> str:
    return f"{segment_prefix(job, node)}r{rank}.s{slot}.g{generation}"


_NAME = re.compile(r"\.r(\d+)\.s(\d+)\.g(\d+)$")


def parse_segment_name(name: str) -> tuple[int, int, int] | None:
    m = _NAME.search(name)
    return tuple(int(x) for x in m.groups()) if m else None
