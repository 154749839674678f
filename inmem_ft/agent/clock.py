"""The time each failure costs on this node, as the agent sees it: the boundaries of agent/timelost.py
recorded from the agent's hooks, the rest from its ranks' records, restore events and heartbeats.

    failure    a hung rank's last heartbeat; for a crash, the last poll that found every local rank running
               (the crash came after it, within the monitor interval)
    detected   the monitor found a rank failed or hung, or a peer node's agent asked for a new round
    stopped    the local ranks are stopped
    launched   the agents' rendezvous is done and the new ranks are being started
    ...        the ranks' rendezvous and restore (their records and restore events)
    back       every local rank's heartbeat is at the step the node had reached (to the monitor interval)
"""
from __future__ import annotations

import time

from . import timelost
from .. import events
from ..telemetry import read_record, write_record


class RecoveryClock:
    def __init__(self, json_path: str, say, events_path: str):
        """`say(event, text=, sep=, **fields)`: where each failure's event goes (the agent's log and events);
        `events_path`: the node's events file, where its ranks' restore events are."""
        self.json_path, self.say = json_path, say
        self._events = events.Reader(events_path)
        self.splits: list[dict] = []
        self._restart: timelost.Restart | None = None
        self._ranks: dict[int, str] = {}  # the restart's ranks: global rank -> its worker record
        self._back: list[dict] = []

    @property
    def pending(self) -> bool:
        return self._restart is not None

    def failed(self, cause: str, beats: dict[int, dict], failed_at: float | None = None, note: str = "") -> None:
        """A failure was detected now; `beats`: the local ranks' last heartbeats (what they had reached)."""
        if self._restart is not None:  # it failed again before training got back
            self._finish(f"the restart failed ({cause}) before training got back to that step")
        now = time.time()
        reached = max((b.get("step", 0) for b in beats.values()), default=None)
        if failed_at is None and not note:
            note = "when it failed is unknown (it died before its first poll): counted from its detection"
        self._restart = timelost.Restart(cause, failed_at, now, now, reached, note)
        self._ranks, self._back = {}, []  # the failed attempt's ranks are not the restart's
        self.say("failure_detected", failure=cause)

    def stopped(self, beats: dict[int, dict]) -> None:
        """The local ranks are stopped; `beats`: their last heartbeats. A rank may still have stepped after the
        failure was detected (a hung rank continued to print its stacks, a survivor finishing a step already under
        way): the steps it beat at were reached, and a snapshot of them may be what the restart restores."""
        r = self._restart
        if r is not None:
            r.stopped_at = time.time()
            last = max((b.get("step", 0) for b in beats.values()), default=None)
            if last is not None and (r.reached is None or last > r.reached):
                r.reached = last

    def launched(self, attempt: int, at: float, ranks: dict[int, str]) -> None:
        """The restart's ranks began to start `at`: `ranks` maps each to its worker record."""
        if self._restart is not None:
            self._restart.attempt, self._restart.launched_at = attempt, at
            self._ranks, self._back = ranks, []

    def resized(self, how: str, nodes: str, spare_wait: tuple[float, float] | None) -> None:
        """The restart runs on another node count (`nodes`: "3->2"); `spare_wait`: (start, end) of its round's
        wait for more nodes, None where it did not wait."""
        r = self._restart
        if r is not None:
            r.resize = {"how": how, "nodes": nodes, "spare_wait": spare_wait}
            if how == "grow":  # what the restart was for: torch restarts for a node waiting to join
                r.cause = f"a node joined ({nodes} nodes)"

    def poll(self, beats: dict[int, dict]) -> None:
        """Training is back once every local rank beat at (or past) the step reached."""
        r = self._restart
        if r is None or r.launched_at is None or len(beats) < len(self._ranks) or not beats:
            return
        step = min(b.get("step", 0) for b in beats.values())
        if r.reached is None or step >= r.reached:
            self._back = [{"step": step, "time": max(b["time"] for b in beats.values())}]
            self._finish()

    def close(self) -> None:
        if self._restart is not None:
            self._finish("the run ended before training got back to that step")

    def _finish(self, end_note: str = "") -> None:
        restart, self._restart = self._restart, None
        since = restart.launched_at if restart.launched_at is not None else restart.detected_at
        new = [r for r in self._events.records() if r["wall"] >= since]
        ranks = {rank: timelost.RankReport(read_record(record), events.where(new, "restore", role="rank", rank=rank))
                 for rank, record in self._ranks.items()}
        split = timelost.measure(restart, ranks, self._back, end_note)
        self.splits.append(split)
        starts = ",".join(f"{how.replace(' ', '_')}:{n}" for how, n in sorted(split["starts"].items()))
        self.say("time_lost", failure=restart.cause, sep=" ", text=f"{timelost.describe(split)} "
                 f"ranks_started={starts or 'none'} (json: {self.json_path})")
        resize = split.get("resize")
        if resize:
            self.say(f"{resize['how']}_parts", nodes=resize["nodes"], total_s=resize["total_s"],
                     **{timelost.field(part): s for part, s in resize["parts"].items()})
        write_record(self.json_path, self.splits)
