"""The few collectives the snapshot protocol needs, on a gloo group of its own: they run from the commit
thread and must never interleave with the training loop's collectives on the default group.

The groups made here are destroyed on every path: Snapshotter.close, and otherwise at interpreter exit (atexit,
which runs after the commit thread is joined and before the interpreter finalizes). A gloo group that outlives
the interpreter aborts the process: each of its worker threads (pt_gloo_runloop) drops a finished collective's
tensors only after the caller's wait returned, and when that tensor's last reference goes while the main thread
is already in Py_FinalizeEx, the worker's GIL request ends the thread (PyThread_exit_thread) by a forced unwind
through a noexcept destructor: std::terminate, "terminate called without an active exception", SIGABRT (issue
23). Dropping the group's last reference while the interpreter lives runs ~ProcessGroupGloo, which joins those
threads (pybind releases the GIL for it), so none is left to race the finalization."""
from __future__ import annotations

import atexit
import logging
import threading
from contextlib import contextmanager
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import teardown
from ..errors import InmemFTError

log = logging.getLogger("inmem_ft.capture")
_made: list = []  # every group an Agreement made and no close destroyed yet (torch's registry holds them anyway)
_open: "weakref.WeakSet[Agreement]" = weakref.WeakSet()  # Agreements not closed: they hold references too
_made_lock = threading.Lock()
_atexit_registered = False


def _made_group(group):
    global _atexit_registered
    with _made_lock:
        _made.append(group)
        if not _atexit_registered:
            atexit.register(destroy_all)
            teardown.destroy_first(destroy_all)  # run_main's exit, before the world's group
            _atexit_registered = True
    return group


def destroy_all() -> None:
    """atexit: destroy every group of ours that no close did (an exception ended the trainer, or its
    Snapshotter was dropped unclosed), and drop every reference of ours to them, so that they go now."""
    with _made_lock:
        agreements, groups = list(_open), _made[:]
        _made.clear()
    for agreement in agreements:
        try:
            agreement.close()
        except Exception:  # exiting anyway: the rank's own error and exit code are what count
            pass
    if groups:
        destroy_bounded(groups, dist.get_rank() if dist.is_initialized() else 0)


def destroy_group(group) -> None:
    """Destroy one process group of ours if torch still knows it (a destroy of the whole world took it already)
    and it is not the world itself. Local for gloo (no collective), but ~ProcessGroupGloo joins the group's worker
    threads, and one still in a collective waits for its peers or the group's timeout (destroy_bounded)."""
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
        return
    if group is dist.group.WORLD:
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # not (or no longer) registered: the world was destroyed, or re-made, since
        pass


def destroy_bounded(groups: list, rank: int) -> None:
    """Destroy `groups` (emptying the list: the caller's references go with it) within teardown.bounded's time:
    close() runs once no collective of ours is in flight here, so a destroy that takes longer waits on a peer."""
    def destroy():
        while groups:
            try:
                destroy_group(groups.pop())  # our last reference goes with the call: ~ProcessGroupGloo joins here
            except Exception as e:  # exiting anyway: the rank's own error and exit code are what count
                log.warning("snapshot rank=%d event=teardown_failed: %s: %s", rank, type(e).__name__, e)

    teardown.bounded(destroy, "the snapshot agreement's gloo group", rank)


class Agreement:
    def __init__(self, timeout_s: float):
        self.distributed = dist.is_available() and dist.is_initialized()
        self._mirrors: list = []  # groups made by mirror() that this rank belongs to
        self._timeout_s = timeout_s
        self._busy = 0  # collectives of min/gather in flight (the commit thread's, a restore's verdict thread's)
        self._idle = threading.Condition()
        self.dp_mirror = None  # mirror()'s answer: the one reference to it outside torch (Snapshotter._dp_gloo)
        if self.distributed:
            self.group = _made_group(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            with _made_lock:
                _open.add(self)
        else:
            self.group, self.rank, self.world_size = None, 0, 1

    def close(self) -> None:
        """Destroy the groups made here and drop this object's references to them, so that (nothing else holding
        them) each gloo group's worker threads are joined now, while the interpreter lives. Idempotent; call it
        once no collective of these groups is in flight on this rank (the commit thread joined)."""
        with self._idle:  # a daemon thread still in a vote (verdict.py) must leave it before the group goes:
            # one in a collective when the interpreter finalizes aborts the process the same way. Bounded: a
            # peer that never votes fails the collective within the group's own timeout anyway.
            self._idle.wait_for(lambda: self._busy == 0, timeout=self._timeout_s)
            groups, self._mirrors = [g for g in (*self._mirrors, self.group) if g is not None], []
            self.group = self.dp_mirror = None
        with _made_lock:
            _made[:] = [g for g in _made if all(g is not mine for mine in groups)]
            _open.discard(self)
        if groups:
            destroy_bounded(groups, self.rank)


    @contextmanager
    def _collective(self):
        """Count a collective in flight (close waits for none); refuse one once closed, where group=None would
        mean the default group, the training loop's own."""
        with self._idle:
            if self.group is None:
                raise InmemFTError("the snapshot agreement is closed (its process groups are destroyed)")
            self._busy += 1
            group = self.group
        try:
            yield group
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def min(self, value: int | list[int]) -> int | list[int]:
        """The smallest `value` of all ranks; of a list, the smallest of each element (one round for all)."""
        if not self.distributed:
            return value
        t = torch.tensor(value, dtype=torch.int64)
        with self._collective() as group:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return t.tolist()

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        if not self.distributed:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self._collective() as group:
            dist.all_gather(out, mine, group=group)
        return [t.tolist() for t in out]

    def gather_bytes(self, data: bytes, size: int) -> list[bytes]:
        """Every rank's `data` (at most `size` bytes, `size` the same on every rank), indexed by rank."""
        if not self.distributed:
            return [data]
        mine = torch.zeros(size, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self._collective() as group:
            out = all_gather_bytes(mine, group)
        return [bytes(row.numpy()).rstrip(b"\0") for row in out.view(-1, size)]

    def mirror(self, group) -> "object | None":
        """A gloo group with the same members as `group` (which may be NCCL), usable from the commit thread.

        new_group is collective over the whole world, so every rank learns every group's members first and
        all ranks create all the mirrors in the same order. A group of the whole world (data parallelism
        alone) gets this agreement's own group: the callers never use both at once (the restore's exchanges
        run on the main thread before any snapshot or background check), and a gloo group of the whole world
        is the costly one to build (a connection between every two ranks).
        """
        if group is None or not self.distributed:
            return None
        self.dp_mirror = self._mirror(group)
        return self.dp_mirror

    def _mirror(self, group):
        members = dist.get_process_group_ranks(group)
        if len(members) == self.world_size:
            return self.group
        rows = self.gather(sorted(members))
        mine = None
        for ranks in sorted({tuple(r) for r in rows}):
            g = dist.new_group(list(ranks), backend="gloo")
            if self.rank in ranks:
                mine = g
        if mine is not None:
            self._mirrors.append(_made_group(mine))
        return mine


def all_gather_bytes(share: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every group member's equal-length uint8 `share`, in group-rank order."""
    out = torch.empty(dist.get_world_size(group) * share.numel(), dtype=share.dtype)
    dist.all_gather(list(out.view(-1, share.numel())), share, group=group)  # straight into one buffer
    return out
