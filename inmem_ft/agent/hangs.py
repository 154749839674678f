"""Hung ranks: which ones, and their stacks into their logs before they are killed.

A rank beats once per step (the Snapshotter's heartbeat, telemetry.Heartbeat: a few stores into a mapped file);
one whose last beat is older than the timeout while it still runs is hung. Before the first beat of a process
(imports, rendezvous, restore) nothing is judged: those phases have no steps to count.
"""
from __future__ import annotations

import os
import signal
import time
from typing import NamedTuple

from ..telemetry import STACK_SIGNAL, read_heartbeats

DUMP_POLL_S = 0.02


def beats_of(directory: str, pids: dict[int, int]) -> dict[int, dict]:
    """The heartbeats of the processes now running (global rank -> pid), only: a file an earlier process of
    the rank left says nothing of now. The one reader of heartbeats for the agent and `inmem-ft launch`."""
    return {r: b for r, b in read_heartbeats(directory).items() if pids.get(r) == b.get("pid")}


def stale(beats: dict[int, dict], now: float, timeout_s: float) -> list[int]:
    """Ranks whose last beat is older than `timeout_s` at `now`, other than those that said they are done."""
    return sorted(r for r, b in beats.items() if not b.get("done") and now - b["time"] > timeout_s)


class Dump(NamedTuple):
    stack: str  # what the rank printed when asked for its stacks ("" when nothing came)
    spared: str  # why it was not killed after all ("" when it was)


def dump_and_kill(hung: dict[int, dict], logs: dict[int, str], directory: str, wait_s: float) -> dict[int, Dump]:
    """Ask the hung ranks (rank -> the beat that judged it hung, rank -> its stderr log) for their stacks
    (telemetry.dump_stacks_on), let them run to answer (they may be stopped), then SIGKILL them: from here on
    each is a crashed rank like any other. A stopped rank runs on while it answers: it is killed as soon as its
    dump is whole (its log stops growing), after `wait_s` at the latest. A rank that beat since it was judged
    (it was slow, not hung) or exited meanwhile is not killed: killing it would turn a slow step into a failure."""
    pids = {r: b["pid"] for r, b in hung.items()}
    sizes = {r: _size(logs[r]) for r in hung}
    for pid in pids.values():
        for signum in (STACK_SIGNAL, signal.SIGCONT):
            _signal(pid, signum)
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
        now = {r: _size(logs[r]) for r in hung}
        if now == last and all(n > sizes[r] for r, n in now.items()):
            break  # every one wrote, and nothing since the last look: the dumps are whole
        last = now
    beats = beats_of(directory, pids)
    out = {}
    for r, judged in hung.items():
        spared = _not_hung(judged, beats.get(r), pids[r])
        if not spared:
            kill(pids[r])
        out[r] = Dump(_stack_in(logs[r], sizes[r]), spared)
    return out


def _not_hung(judged: dict, beat: dict | None, pid: int) -> str:
    """Why a rank judged hung on beat `judged` is not hung now that its last beat is `beat`, or ""."""
    if beat is not None and (beat["time"] > judged["time"] or beat.get("done")):
        return f"it beat again (step {beat.get('step', '?')}) while its stacks were dumped"
    if _exited(pid):
        return "it exited while its stacks were dumped"
    return ""


def _exited(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (exited, its parent has not waited for it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")  # the state follows the command name's ")"


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
