"""Run a training command on a simulated cluster, inject failures, restart, and keep a timeline.

The supervisor does what torchrun's agent and an operator do on a real cluster: when a rank dies or stops
sending heartbeats it stops the survivors and restarts every rank (on warm standbys, where the cluster keeps
them); when a node is lost it brings up a replacement SMP under the lost node's id. The ranks themselves
decide where to restore from. For each failure it measures the time until training is back at the step it
had reached, part by part (launcher/timelost.py).
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import telemetry
from ..agent import hangs
from ..errors import ConfigError
from . import timelost
from .simulated import SimulatedCluster

POLL_S = 0.05  # heartbeats, failure injection, recovery; a rank's exit wakes the supervisor at once


@dataclass
class Failure:
    kind: str  # "rank": kill -9 one rank; "node": lose a whole node; "hang": stop a rank (SIGSTOP)
    step: int
    target: int
    fired: bool = False

    _SPEC = re.compile(r"^(\d+):(\d+)$")
    OPTIONS = {"rank": "--kill-rank", "node": "--kill-node", "hang": "--hang-rank"}

    @classmethod
    def parse(cls, kind: str, spec: str) -> "Failure":
        m = cls._SPEC.match(spec)
        if not m:
            target = "NODE" if kind == "node" else "RANK"
            raise ConfigError(f"{cls.OPTIONS[kind]} {spec!r}: expected STEP:{target}, e.g. 12:1")
        return cls(kind, int(m.group(1)), int(m.group(2)))

    def check(self, nodes: int, world_size: int) -> None:
        """Refuse a failure that cannot happen in this job, before anything starts."""
        count, what = (nodes, "node") if self.kind == "node" else (world_size, "rank")
        if self.target >= count:
            raise ConfigError(f"{self.OPTIONS[self.kind]} {self.step}:{self.target}: the job has {count} {what}s "
                             f"(0..{count - 1}), so this failure could never happen")

    def describe(self) -> str:
        return {"rank": f"kill -9 rank {self.target}", "node": f"lose node {self.target} (processes, SMP, memory)",
                "hang": f"hang rank {self.target} (SIGSTOP)"}[self.kind] + f" at step {self.step}"


@dataclass
class Event:
    t: float
    kind: str
    text: str
    step: int | None = None


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    reference: dict[int, float] | None = None
    failures: list[tuple[int, str]] = field(default_factory=list)  # (step, description) for the plot
    missed: list[str] = field(default_factory=list)  # requested failures the run never reached
    time_lost: list[dict] = field(default_factory=list)  # per restart: timelost.measure()
    ok: bool = False

    @property
    def passed(self) -> bool:
        """Finished, every requested failure happened, and (when compared) on the reference's losses."""
        return self.ok and not self.missed and self.matches_reference is not False

    @property
    def matches_reference(self) -> bool | None:
        if self.reference is None:
            return None
        return bool(self.losses) and self.losses == self.reference

    HEADER = f"{'t (s)':>7}  {'event':<10}  details"

    @staticmethod
    def line(e: Event) -> str:
        return f"{e.t:7.1f}  {e.kind:<10}  {e.text}"

    def format(self) -> str:
        return "\n".join([self.HEADER] + [self.line(e) for e in self.events])


class Supervisor:
    def __init__(self, cluster: SimulatedCluster, argv: list[str], failures: list[Failure], *,
                 heartbeat_timeout_s: float = 60.0, max_restarts: int = 5, work_dir: str,
                 live: Callable[[str], None] | None = None):
        """`live` gets each timeline line as it happens (the CLI prints them)."""
        self.cluster, self.argv, self.failures, self.live = cluster, argv, failures, live
        self.heartbeat_timeout_s, self.max_restarts, self.work_dir = heartbeat_timeout_s, max_restarts, work_dir
        self.loss_log = os.path.join(work_dir, "loss.jsonl")
        self._losses = telemetry.Tail(self.loss_log)
        self._loss_records: list[dict] = []
        self.timeline = Timeline()
        self._t0 = time.monotonic()
        # (attempt, step) -> {rank: stall seconds} as each rank's heartbeat reported the snapshot
        self._snapshots: dict[tuple[int, int], dict[int, float] | None] = {}  # None: reported
        self._lost_nodes: list[int] = []
        self._injected: list[tuple[float, str]] = []  # this attempt's failures: (time.time() of the signal, what)
        self._restart: timelost.Restart | None = None  # the failure being recovered from
        self._standbys_started = False  # this attempt's
        self._smp_logs: dict[int, telemetry.Tail] = {}  # replaced node -> its new SMP's lines in its log
        # With erasure coding, every SMP's log (its replacements append to it): which step is protected, when.
        self._ec_logs = {node: telemetry.Tail(cluster.smp_log(node), from_end=True)
                         for node in range(cluster.nodes)} if cluster.ec is not None else {}
        self._protecting: dict[int, set[int]] = {}  # step -> nodes that logged it protected, until all have
        self._protect_reasons: dict[int, str] = {}  # step -> why a node protected it other than on `complete`
        self.protected: tuple[int, float] | None = None  # (step, timeline time) it was protected on every node

    def event(self, kind: str, text: str, step: int | None = None) -> None:
        e = Event(time.monotonic() - self._t0, kind, text, step)
        self.timeline.events.append(e)
        if self.live:
            self.live(Timeline.line(e))

    def run(self) -> Timeline:
        for attempt in range(self.max_restarts + 1):
            for node in self._lost_nodes:
                self._smp_logs[node] = telemetry.Tail(self.cluster.smp_log(node), from_end=True)
                self.cluster.start_smp(node)
                self.event("replace", f"node {node}: replacement SMP started empty under the lost node's id")
            self._lost_nodes = []
            if self._attempt(attempt + 1):
                self.timeline.ok = True
                break
        else:
            self.event("give up", f"still failing after {self.max_restarts} restarts")
        if self._restart is not None:
            self._measured(self._restart, "the run ended before training got back to that step")
        self.timeline.losses = telemetry.read_losses(self.loss_log)
        last = max(self.timeline.losses, default=0)
        for f in self.failures:
            if not f.fired:
                self.timeline.missed.append(f.describe())
                self.event("missed", f"{f.describe()} never happened: the job stopped at step {last}")
        return self.timeline

    def _attempt(self, number: int) -> bool:
        hb_dir = os.path.join(self.work_dir, f"heartbeats{number}")
        os.makedirs(hb_dir, exist_ok=True)
        self.cluster.launch(self.argv, {telemetry.HEARTBEAT_DIR: hb_dir, telemetry.LOSS_LOG: self.loss_log})
        self._injected, self._standbys_started = [], False
        if self._restart is not None:
            self._restart.attempt, self._restart.launched_at = number, self.cluster.launched_at
        standby = self.cluster.starts.get("standby", 0)
        self.event("start", f"attempt {number}: {self.cluster.world_size} ranks on {self.cluster.nodes} nodes"
                            + (f" ({standby} handed to warm standbys)" if standby else ""))
        t0, restored_seen = time.monotonic(), False
        while True:
            beats = self._beats(hb_dir)
            self._loss_records += self._losses.records()
            restored_seen = self._note_restore(beats, restored_seen)
            self._note_snapshots(beats)
            self._note_recovery()
            self._note_rebuilds()
            self._note_protection()
            self._start_standbys()
            self._inject(beats)
            hung = self._hung(beats)
            failed = self.cluster.failed_ranks()
            if hung or failed:
                self._detected(t0, failed, hung, beats)
                return False
            if not self.cluster.running():
                self.cluster.end_attempt(t0)
                self.event("finished", f"attempt {number}: every rank exited cleanly")
                return True
            self.cluster.failure.wait(POLL_S)

    def _detected(self, t0: float, failed: list[int], hung: list[int], beats: dict) -> None:
        """Stop the attempt and remember what the failure will have cost once training is back."""
        detected_at = time.time()
        exit_times = dict(self.cluster.exit_times)
        attempt = self.cluster.end_attempt(t0, failed[0] if failed else hung[0])
        stopped_at = time.time()
        why = self._describe_exit(attempt, failed[0]) if failed else self._describe_hang(beats, hung)
        if (failed and self._restart is not None and attempt.returncodes[failed[0]] > 0
                and self.cluster.started_as.get(failed[0]) == "standby"):
            self._standbys_off(failed[0], why)
        if self._injected:
            failed_at, cause = self._injected[0]
            note = ""
        elif failed:
            failed_at, cause, note = exit_times.get(failed[0]), why, ""
        else:
            failed_at, cause = None, why
            note = "the rank stopped by itself: when is unknown, so the time lost is counted from its detection"
        if self._restart is not None:  # it failed again before training got back
            self._measured(self._restart, f"the restart failed ({why}) before training got back to that step")
        self._loss_records += self._losses.records()  # complete now: every rank of the attempt is gone
        reached = max((r["step"] for r in self._loss_records if r["time"] <= (failed_at or detected_at)),
                      default=None)
        self._restart = timelost.Restart(cause, failed_at, detected_at, stopped_at, reached, note,
                                         protected=self.protected[0] if self.protected else None)
        self.event("detected", f"{why}; survivors stopped, all ranks restart{self._protection_now()}",
                   reached if reached is not None else max((b.get("step", 0) for b in beats.values()), default=0))

    def _protection_now(self) -> str:
        """What a node lost now would be rebuilt at, for the timeline (nothing without erasure coding)."""
        if not self._ec_logs:
            return ""
        if self.protected is None:
            return "; no step protected on every node"
        return f"; step {self.protected[0]} protected on every node since {self.protected[1]:.1f} s"

    def _note_recovery(self) -> None:
        """Training is back at the step the failure interrupted: how long that took, and where the time went."""
        r = self._restart
        if r is None or r.launched_at is None:
            return
        since = [rec["step"] for rec in self._loss_records if rec["time"] > r.launched_at]
        if since and (r.reached is None or max(since) >= r.reached):
            split = self._measured(r)
            where = "training again" if r.reached is None else f"back at step {r.reached}"
            self.event("recovered", f"{where}: {timelost.describe(split)}", r.reached)

    def _measured(self, restart: timelost.Restart, end_note: str = "") -> dict:
        ranks = {}
        if restart.attempt is not None:
            for rank in range(self.cluster.world_size):
                ranks[rank] = timelost.RankReport(self.cluster.worker_record(restart.attempt, rank),
                                                  self.cluster.rank_log(restart.attempt, rank))
        split = timelost.measure(restart, ranks, self._loss_records, end_note)
        self.timeline.time_lost.append(split)
        self._restart = None
        if end_note:  # never back: say what could be measured
            self.event("time lost", f"{restart.cause}: {timelost.describe(split)}")
        return split

    def _start_standbys(self) -> None:
        """Warm standbys for the next restart, once nothing is being recovered (their imports would slow the
        recovery) and the ranks have rendezvoused (so there is a list of their imports to follow)."""
        if self._standbys_started or self._restart is not None or not self.cluster.standbys:
            return
        started = self.cluster.start_standbys()
        if started:
            self._standbys_started = True
            self.event("standby", f"{started} warm standby process(es) started: each imports what its rank has "
                                  f"imported, and waits to take over a rank in the next restart")
        elif self.cluster.standbys.refused:
            self._standbys_started = True
            self.event("standby", f"warm standbys off, restarts start cold: {self.cluster.standbys.refused}")

    def _standbys_off(self, rank: int, why: str) -> None:
        """A rank a standby started failed on its own before training got back: most likely the command's
        imports depend on what it does before them (a patch that must come before an import), which a standby
        has imported already. Cold starts from now on; the job goes on."""
        self.cluster.standbys_off()
        self.event("standby", f"warm standbys off, restarts start cold: rank {rank}, started from a warm standby, "
                              f"failed before training got back ({why}); a command whose imports must follow "
                              f"something it does first needs cold starts (--no-standby)")

    def _beats(self, hb_dir: str) -> dict[int, dict]:
        """Heartbeats of the processes this attempt started, only: a file another run or attempt left
        behind says nothing of now."""
        return hangs.beats_of(hb_dir, {r: proc.pid for r, proc in self.cluster.procs.items()})

    def _note_restore(self, beats: dict, seen: bool) -> bool:
        if seen or len(beats) < self.cluster.world_size or any("restored" not in b for b in beats.values()):
            return seen
        restored = [b["restored"] for b in beats.values()]
        if all(r is None for r in restored):
            self.event("restore", "no snapshot: starting from step 0")
        else:
            r = max(restored, key=lambda x: x["seconds"])
            if self.protected is not None and self.protected[0] > r["step"]:
                self.protected = None  # the SMPs dropped the parity of the steps after the one resumed from
            sources = sorted({x["source"] for x in restored if x})
            self.event("restore", f"step {r['step']} from {' + '.join(sources)} in {r['seconds']:.3f} s "
                                  f"(slowest rank)", r["step"])
        return True

    def _note_snapshots(self, beats: dict) -> None:
        """A snapshot once every rank has reported it (in any poll: ranks rarely sit on the same step at
        once). A rank that took two snapshots between polls reports only the second; that step still shows."""
        for rank, beat in beats.items():
            if beat.get("snapshot_step") is not None:
                key = (self.cluster.attempts, beat["snapshot_step"])
                stalls = self._snapshots.setdefault(key, {})
                if stalls is not None:
                    stalls[rank] = beat["stall_s"]
                    if len(stalls) == self.cluster.world_size:
                        self._snapshots[key] = None  # reported
                        self.event("snapshot", f"step {key[1]}: training blocked {max(stalls.values()) * 1e3:.1f} "
                                               f"ms (slowest rank)", key[1])

    _REBUILD = re.compile(r"event=(rebuild_start|rebuilt|rebuild_failed) (.*)$")

    def _note_rebuilds(self) -> None:
        """A replacement SMP's rebuild, as its log reports it."""
        for node, tail in self._smp_logs.items():
            for line in tail.lines():
                m = self._REBUILD.search(line)
                if m:
                    what = {"rebuild_start": "rebuilding", "rebuilt": "rebuilt",
                            "rebuild_failed": "rebuild FAILED"}[m.group(1)]
                    self.event("rebuild", f"node {node} {what} from its EC group: {m.group(2)}")

    _PROTECT = re.compile(r"ec node=(\d+) event=(protected|protect_failed|protect) step=(\d+)\b(?:.*? reason=(.*))?")

    def _note_protection(self) -> None:
        """Which step is protected from when: once every node's SMP logged it protected (each holds its parity),
        a node lost from then on is rebuilt at that step. A node that failed to protect one says why."""
        for node, tail in self._ec_logs.items():
            for line in tail.lines():
                m = self._PROTECT.search(line)
                if not m:
                    continue
                what, step, reason = m.group(2), int(m.group(3)), m.group(4) or ""
                if what == "protect":  # not on a `complete`: the job resumed from it, or an SMP restarted
                    self._protect_reasons[step] = reason
                elif what == "protect_failed":
                    self._protecting.pop(step, None)
                    reason = reason.split(": the step is not protected")[0]
                    self.event("ec failed", f"node {node}: protecting step {step} failed ({reason}); a node lost "
                                            f"now is rebuilt at an older step, if any", step)
                else:
                    nodes = self._protecting.setdefault(step, set())
                    nodes.add(int(m.group(1)))
                    if len(nodes) == self.cluster.nodes:
                        del self._protecting[step]
                        why = self._protect_reasons.pop(step, "")
                        self.event("protected", f"step {step} on every node (erasure-coded across its EC group): a "
                                                f"node lost from now on is rebuilt at step {step}"
                                   + (f" [protected because {why}]" if why else ""), step)
                        self.protected = (step, self.timeline.events[-1].t)

    def _inject(self, beats: dict) -> None:
        for f in self.failures:
            if f.fired:
                continue
            watched = ([r for r in range(self.cluster.world_size) if self.cluster.node_of(r) == f.target]
                       if f.kind == "node" else [f.target])
            if not all(beats.get(r, {}).get("step", -1) >= f.step for r in watched):
                continue
            f.fired = True
            # The supervisor polls: a fast trainer may be past the requested step when the signal lands.
            reached = max(beats[r]["step"] for r in watched)
            text = f.describe() + (f" (reached step {reached} when it landed)" if reached != f.step else "")
            self.timeline.failures.append((reached, text))
            self.event("failure", text, reached)
            self._injected.append((time.time(), text))
            if f.kind == "rank":
                self.cluster.procs[f.target].send_signal(signal.SIGKILL)
            elif f.kind == "hang":
                self.cluster.procs[f.target].send_signal(signal.SIGSTOP)
            else:
                self.cluster.lose_node(f.target)
                self._lost_nodes.append(f.target)

    def _hung(self, beats: dict) -> list[int]:
        """Live ranks of this attempt silent past the timeout. A hung rank soon silences its peers too (they
        wait on it in a collective), so each silent one is named; any one of them is reason to restart."""
        return [rank for rank in hangs.stale(beats, time.time(), self.heartbeat_timeout_s)
                if self.cluster.procs[rank].poll() is None]

    def _describe_exit(self, attempt, rank: int) -> str:
        code = attempt.returncodes[rank]
        if code < 0:
            return f"rank {rank} exited with {code}"
        # An error exit: its last log line (the exception, for a Python trainer) says why.
        lines = [line.strip() for line in self.cluster.rank_log(attempt.number, rank).splitlines() if line.strip()]
        return f"rank {rank} exited with {code}" + (f" ({lines[-1][:300]})" if lines else "")

    def _describe_hang(self, beats: dict, hung: list[int]) -> str:
        now = time.time()
        last = ", ".join(f"rank {r} at step {beats[r].get('step', 0)} {now - beats[r]['time']:.0f} s ago"
                         for r in sorted(hung, key=lambda r: beats[r]["time"]))
        return (f"no heartbeat for over {self.heartbeat_timeout_s:g} s from rank(s) {hung} (hung; last beats: "
                f"{last})")
