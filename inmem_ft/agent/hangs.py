"""Hung ranks: which ones, and their stacks into their logs before they are killed.

A rank beats once per step (the Snapshotter's heartbeat, telemetry.Heartbeat: a few stores into a mapped file);
one whose last beat is older than the timeout while it still runs is hung. Before the first beat of a process
(imports, rendezvous, restore) nothing is judged: those phases have no steps to count.
"""
from __future__ import annotations

import os
import signal
import time

from ..telemetry import STACK_SIGNAL, read_heartbeats

DUMP_POLL_S = 0.02


def beats_of(directory: str, pids: dict[int, int]) -> dict[int, dict]:
    """The heartbeats of the processes now running (global rank -> pid), only: a file an earlier process of
    the rank left says nothing of now. The one reader of heartbeats for the agent and `inmem-ft launch`."""
    return {r: b for r, b in read_heartbeats(directory).items() if pids.get(r) == b.get("pid")}


def stale(beats: dict[int, dict], now: float, timeout_s: float) -> list[int]:
    """Ranks whose last beat is older than `timeout_s` at `now`, other than those that said they are done."""
    return sorted(r for r, b in beats.items() if not b.get("done") and now - b["time"] > timeout_s)


def dump_and_kill(pids: dict[int, str], wait_s: float) -> dict[int, str]:
    """Ask the processes (pid -> its stderr log) for their stacks (telemetry.dump_stacks_on), let them run to
    answer (they may be stopped), then SIGKILL them: from here on each is a crashed rank like any other.
    Returns what each printed. A stopped rank runs on while it answers: it is killed as soon as its dump is
    whole (its log stops growing), after `wait_s` at the latest."""
    sizes = {pid: _size(log) for pid, log in pids.items()}
    for pid in pids:
        for signum in (STACK_SIGNAL, signal.SIGCONT):
            _signal(pid, signum)
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
        now = {pid: _size(log) for pid, log in pids.items()}
        if now == last and all(n > sizes[pid] for pid, n in now.items()):
            break  # every one wrote, and nothing since the last look: the dumps are whole
        last = now
    for pid in pids:
        kill(pid)
    return {pid: _stack_in(log, sizes[pid]) for pid, log in pids.items()}


def kill(pid: int) -> None:
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it exited meanwhile
        pass


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _stack_in(log: str, since: int) -> str:
    """What the rank wrote to its log from byte `since` on: faulthandler's dump, when it answered."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    start = text.find("Thread 0x")
    if start < 0:
        start = text.find("Current thread 0x")
    return text[start:].rstrip() if start >= 0 else ""
