"""Run a training command on a simulated cluster, inject failures, and keep a timeline.

Each simulated node is what runs on a real one: `inmem-ft run` (agent/agent.py, torch's elastic agent with
inmem_ft's), which starts and supervises its node's SMP and ranks, finds crashed and hung ranks, restarts the
ranks and measures the time each failure cost. What is here is what the cluster and an operator do: the
agents' rendezvous store (a cluster's rendezvous service: it outlives any node), the failures, injected from
outside (kill -9 a rank, stop one, lose a node: its agent, ranks, SMP and memory, then a replacement agent under
the node's id, as SLURM or Kubernetes would start one), and the timeline, drawn from what the agents, their
ranks and the SMPs report.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable


from .. import events, telemetry
from ..agent import hangs
from ..cluster.options import ECOptions
from ..errors import ConfigError
from ..smp import control, inventory, nodelock, paths
from ..agent import timelost
from .ports import free_port

POLL_S = 0.05  # heartbeats and failure injection; also the agents' monitor interval
STOP_WAIT_S = 30.0  # how long agents get to stop their ranks and SMPs once the run is over


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


class NodeAgent:
    """One node's `inmem-ft run`, in a session of its own (so that losing the node takes its ranks with it)."""

    def __init__(self, node: int, incarnation: int, command: list[str], argv: list[str], env: dict, work_dir: str):
        self.node = node
        self.work_dir = os.path.join(work_dir, "agents", f"node{node}-{incarnation}")
        self.log = os.path.join(work_dir, "logs", f"agent-node{node}-{incarnation}.log")
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*command, "--work-dir", self.work_dir, "--", *argv], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.events = events.Reader(os.path.join(self.work_dir, events.FILE))  # its own, its SMP's, its ranks'
        self.reported = 0  # entries of its time_lost.json already taken
        self._pids: tuple[str, dict[int, int]] = ("", {})  # the newest attempt's ranks' pids, as found so far

    def attempt_dir(self) -> str | None:
        """Where the agent's newest attempt keeps its ranks' records and heartbeats."""
        numbers = [int(n[len("attempt"):]) for n in os.listdir(self.work_dir)
                   if n.startswith("attempt") and n[len("attempt"):].isdigit()] if os.path.isdir(self.work_dir) else []
        return os.path.join(self.work_dir, f"attempt{max(numbers)}") if numbers else None

    def beats(self) -> dict[int, dict]:
        """The heartbeats of the ranks the agent runs now (global rank -> beat), by their worker records' pids."""
        beats = self._newest_beats()
        return {r: b for r, b in beats.items() if _running(b["pid"])}

    def finished(self) -> list[int]:
        """The ranks of the agent's newest attempt whose last beat said they are done training, exited or not."""
        return sorted(r for r, b in self._newest_beats().items() if b.get("done"))

    def _newest_beats(self) -> dict[int, dict]:
        """The last beats of the newest attempt's ranks, by their worker records' pids, running or not."""
        attempt = self.attempt_dir()
        if attempt is None:
            return {}
        if self._pids[0] != attempt:
            self._pids = (attempt, {})
        pids = self._pids[1]
        for name in os.listdir(attempt):  # a rank's record names its pid once it runs; read each once
            m = re.fullmatch(r"rank(\d+)\.json", name)
            if m and int(m.group(1)) not in pids:
                record = telemetry.read_record(os.path.join(attempt, name))
                if record and record.get("pid"):
                    pids[int(m.group(1))] = record["pid"]
        return hangs.beats_of(os.path.join(attempt, "heartbeats"), pids)

    def new_splits(self) -> list[dict]:
        """What the agent's clock measured since the last look (agent/clock.py)."""
        splits = telemetry.read_record(os.path.join(self.work_dir, "time_lost.json")) or []
        new, self.reported = splits[self.reported:], len(splits)
        return new

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL the agent and every process under it, as a node's power loss would: `ranks` (pids) first,
        before the job can take another step without them, then whatever else runs under the agent."""
        os.kill(self.proc.pid, signal.SIGSTOP)  # it starts nothing more
        for pid in ranks:
            hangs.kill(pid)
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            hangs.kill(pid)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, on which the agent stops its ranks and its SMP; SIGKILL past STOP_WAIT_S."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill([])


class Supervisor:
    def __init__(self, nodes: int, ranks_per_node: int, job: str, memory_budget: int, argv: list[str],
                 failures: list[Failure], *, work_dir: str, env: dict, heartbeat_timeout_s: float = 60.0,
                 max_restarts: int = 5, parity: int | None = None, group_size: int | None = None,
                 standby: bool = True, live: Callable[[str], None] | None = None):
        """`live` gets each timeline line as it happens (the CLI prints them). `parity` m turns erasure coding on
        across the nodes' SMPs."""
        self.nodes, self.job, self.argv = nodes, paths.check_job(job), argv
        self.world_size = nodes * ranks_per_node
        self.failures, self.live, self.work_dir = failures, live, work_dir
        self.max_restarts = max_restarts
        self.loss_log = os.path.join(work_dir, "loss.jsonl")
        first = free_port(nodes)  # one block, reserved until this process exits: no two nodes share a port
        peers = ",".join(f"{n}=127.0.0.1:{first + n}" for n in range(nodes))
        self.ec = None if parity is None else ECOptions(parity, nodes, peers, group_size)
        smp_args = self.ec.argv() if self.ec else ["--peers", peers]
        # As torchrun does: one intra-op thread per rank unless told otherwise; ranks share the cores.
        self.env = {"OMP_NUM_THREADS": "1", **os.environ, **env, telemetry.LOSS_LOG: self.loss_log}
        self.env.pop(events.EVENTS, None)  # each agent's in its work dir, where NodeAgent reads it
        self._store = None
        self._command = ["--nnodes", str(nodes), "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d",
                         "--rdzv-id", self.job, "--max-restarts", str(max_restarts), "--monitor-interval", str(POLL_S),
                         "--job", self.job, "--memory-budget", str(memory_budget), "--smp-args", shlex.join(smp_args),
                         "--hang-timeout", f"{heartbeat_timeout_s:g}", "--wipe-on-exit", "1",
                         *([] if standby else ["--standbys", "0"])]
        self.agents: dict[int, NodeAgent] = {}
        self.incarnations: dict[int, int] = {}
        self.timeline = Timeline()
        self._t0 = time.monotonic()
        self._generation = 0  # failures detected so far: the ranks' snapshots and restores are keyed by it
        self._snapshots: dict[tuple[int, int], dict[int, float] | None] = {}  # (generation, step) -> stalls
        self._restored_seen = False
        self._gone: set[int] = set()  # pids of ranks a detected failure ended (they may beat a moment longer)
        self._injected: list[tuple[float, str, str]] = []  # (time.time(), what, kind): injected, not recovered yet
        self._detected_by: int | None = None  # the node whose agent noticed the failure being recovered first
        self._protected_then: int | None = None  # with erasure coding: the step protected on every node then
        self._replaced: set[int] = set()  # nodes whose SMP started empty in a replacement (it rebuilds)
        self._protecting: dict[int, set[int]] = {}  # step -> nodes that logged it protected, until all have
        self._protect_reasons: dict[int, str] = {}  # step -> why a node protected it other than on `complete`
        self.protected: tuple[int, float] | None = None  # (step, timeline time) it was protected on every node

    def event(self, kind: str, text: str, step: int | None = None) -> None:
        e = Event(time.monotonic() - self._t0, kind, text, step)
        self.timeline.events.append(e)
        if self.live:
            self.live(Timeline.line(e))

    # ---- the cluster ------------------------------------------------------------------------------------------
    def _start_agent(self, node: int) -> None:
        """Node `node`'s agent. Torch numbers the nodes of a rendezvous in the order of their addresses: each
        gets a loopback address of its own, in node order, so that a replacement takes the lost node's place."""
        self.incarnations[node] = self.incarnations.get(node, 0) + 1
        command = [sys.executable, "-m", "inmem_ft", "run", *self._command,
                   "--rdzv-endpoint", f"127.0.0.1:{self._store.port}", "--rdzv-conf", "is_host=0",
                   "--local-addr", f"127.0.{1 + node // 200}.{100 + node % 200}", "--node-rank", str(node)]
        env = {**self.env, "INMEM_FT_NODE": str(node)}
        self.agents[node] = NodeAgent(node, self.incarnations[node], command, self.argv, env, self.work_dir)

    def run(self) -> Timeline:
        from torch.distributed import TCPStore

        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            for node in range(self.nodes):
                self._start_agent(node)
            self.event("start", f"{self.world_size} ranks on {self.nodes} nodes, each node's ranks and SMP "
                                f"under an agent of its own (inmem-ft run)")
            self._watch()
        finally:
            self._shut_down()
        self.timeline.losses = telemetry.read_losses(self.loss_log)
        last = max(self.timeline.losses, default=0)
        for f in self.failures:
            if not f.fired:
                self.timeline.missed.append(f.describe())
                self.event("missed", f"{f.describe()} never happened: the job stopped at step {last}")
        return self.timeline

    def _watch(self) -> None:
        while True:
            beats = self._beats()
            self._inject(beats)  # first: a fast trainer is steps further by the end of a poll
            new = {node: agent.events.records() for node, agent in self.agents.items()}
            self._note_agents(beats, new)
            self._note_restore(beats)
            self._note_snapshots(beats)
            self._note_recovery()
            self._note_rebuilds(new)
            self._note_protection(new)
            if self._landed_after_the_end():
                return
            codes = {n: a.proc.poll() for n, a in self.agents.items()}
            failed = {n: c for n, c in codes.items() if c not in (None, 0)}
            if failed:
                node, code = min(failed.items())
                self.event("give up", f"node {node}'s agent exited with {code}: still failing after "
                                      f"{self.max_restarts} restarts, or could not go on (see its log)")
                return
            if all(c == 0 for c in codes.values()):
                self._note_recovery()
                self.timeline.ok = True
                self.event("finished", "every rank exited cleanly")
                return
            time.sleep(POLL_S)

    def _landed_after_the_end(self) -> bool:
        """A node loss or hang injected once the job had finished its last step (a rank beat done: every rank is
        past the job's last collective) interrupts no training, and no agent would ever detect it: the lost node's
        survivors wait in torch's exit barrier for its agent (300 s), a rank that said done is never judged hung.
        The job is over: it counts as finished, the failure as missed. (A killed rank's exit is always seen.)"""
        if not self._injected or self._detected_by is not None or self._injected[0][2] == "rank":
            return False
        done = sorted(r for agent in self.agents.values() for r in agent.finished())
        if not done:
            return False
        what = self._injected.pop(0)[1]
        self.timeline.missed.append(f"{what}: landed after the job's last step")
        self.event("missed", f"{what} landed after the job's last step (rank(s) {done} had finished training), "
                             f"so it interrupted nothing: the run ends here")
        self.timeline.ok = True
        return True

    def _shut_down(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for node in range(self.nodes):  # what a killed agent could not stop
            socket = paths.default_socket(self.job, node)
            if os.path.exists(socket) and control.ping(socket):
                control.stop(socket, wipe=True)
            inventory.remove(self.job, node)
        self._store = None

    def _beats(self) -> dict[int, dict]:
        beats = {}
        for agent in self.agents.values():
            if agent.running():
                for rank, beat in agent.beats().items():
                    if beat["pid"] not in self._gone:
                        beats[rank] = {**beat, "node": agent.node}
        return beats

    def _lose_node(self, node: int, ranks: list[int]) -> None:
        """Its agent and ranks (pids), its SMP and its shared memory; then a replacement agent under its id."""
        self.agents[node].kill(ranks)
        # The SMP, by the lock it holds on the node's memory (a busy one may not answer a ping in time); gone
        # once the lock is free, which its exit releases.
        while (pid := nodelock.holder(self.job, node)) is not None:
            if pid:
                hangs.kill(pid)
            time.sleep(0.01)
        inventory.remove(self.job, node)
        self._replaced.add(node)
        self._start_agent(node)
        self.event("replace", f"node {node}: a replacement agent started under the lost node's id; its SMP "
                              f"starts empty")

    # ---- what the agents report ---------------------------------------------------------------------------
    def _note_agents(self, beats: dict, new: dict[int, list[dict]]) -> None:
        """A failure an agent detected: the first agent to notice one speaks for the restart that follows."""
        for node, records in new.items():
            for r in records:
                if r["source"]["role"] != "agent":
                    continue
                if r["event"] == "standbys_off":
                    self.event("standby", f"node {node}'s agent: standbys off{r['text']}")
                if r["event"] != "failure_detected" or self._detected_by is not None:
                    continue
                self._detected_by, self._restored_seen = node, False
                self._gone |= {b["pid"] for b in beats.values()}  # every rank restarts
                self._protected_then = self.protected[0] if self.protected else None
                self._generation += 1
                reached = max((r["step"] for r in telemetry.Tail(self.loss_log).records()), default=None)
                self.event("detected", f"node {node}'s agent: {r['fields']['failure']}; every rank restarts"
                                       f"{self._protection_now()}", reached)

    def _note_recovery(self) -> None:
        """Training is back at the step the failure interrupted: what it cost, as the detecting agent measured."""
        for agent in list(self.agents.values()):
            for split in agent.new_splits():
                if agent.node != self._detected_by:
                    continue  # every node's agent measures the same restart; one speaks for it
                self._detected_by = None
                if self._injected:
                    at, what, _ = self._injected.pop(0)
                    split = timelost.counted_from(split, what, at)
                split = {**split, "protected_step": self._protected_then}
                self.timeline.time_lost.append(split)
                where = "training again" if split["reached_step"] is None else f"back at step {split['reached_step']}"
                kind = "recovered" if split["total_s"] is not None else "time lost"
                self.event(kind, f"{where}: {timelost.describe(split)}", split["reached_step"])

    def _protection_now(self) -> str:
        """What a node lost now would be rebuilt at, for the timeline (nothing without erasure coding)."""
        if self.ec is None:
            return ""
        if self.protected is None:
            return "; no step protected on every node"
        return f"; step {self.protected[0]} protected on every node since {self.protected[1]:.1f} s"

    def _note_restore(self, beats: dict) -> None:
        if (self._restored_seen or len(beats) < self.world_size
                or any("restored" not in b for b in beats.values())):
            return
        self._restored_seen = True
        restored = [b["restored"] for b in beats.values()]
        if all(r is None for r in restored):
            self.event("restore", "no snapshot: starting from step 0")
            return
        r = max((x for x in restored if x), key=lambda x: x["seconds"])
        if self.protected is not None and self.protected[0] > r["step"]:
            self.protected = None  # the SMPs dropped the parity of the steps after the one resumed from
        sources = sorted({x["source"] for x in restored if x})
        self.event("restore", f"step {r['step']} from {' + '.join(sources)} in {r['seconds']:.3f} s "
                              f"(slowest rank)", r["step"])

    def _note_snapshots(self, beats: dict) -> None:
        """A snapshot once every rank has reported it (in any poll: ranks rarely sit on the same step at
        once). A rank that took two snapshots between polls reports only the second; that step still shows."""
        for rank, beat in beats.items():
            if beat.get("snapshot_step") is not None:
                key = (self._generation, beat["snapshot_step"])
                stalls = self._snapshots.setdefault(key, {})
                if stalls is not None:
                    stalls[rank] = beat["stall_s"]
                    if len(stalls) == self.world_size:
                        self._snapshots[key] = None  # reported
                        self.event("snapshot", f"step {key[1]}: training blocked {max(stalls.values()) * 1e3:.1f} "
                                               f"ms (slowest rank)", key[1])

    _REBUILDS = {"rebuild_start": "rebuilding", "rebuilt": "rebuilt", "rebuild_failed": "rebuild FAILED"}

    def _note_rebuilds(self, new: dict[int, list[dict]]) -> None:
        """A replacement SMP's rebuild, as it reports it."""
        for node in self._replaced:
            for r in new.get(node, []):
                what = self._REBUILDS.get(r["event"]) if r["source"]["role"] == "smp" else None
                if what:
                    self.event("rebuild", f"node {node} {what} from its EC group: {events.details(r)}")

    def _note_protection(self, new: dict[int, list[dict]]) -> None:
        """Which step is protected from when: once every node's SMP said it protected (each holds its parity),
        a node lost from then on is rebuilt at that step. A node that failed to protect one says why."""
        if self.ec is None:
            return
        for node, records in new.items():
            for r in records:
                what = r["event"]
                if r["source"]["role"] != "smp" or what not in ("protected", "protect_failed", "protect"):
                    continue
                step, reason = r["fields"]["step"], r["fields"].get("reason", "")
                if what == "protect":  # not on a `complete`: the job resumed from it, or an SMP restarted
                    self._protect_reasons[step] = reason
                elif what == "protect_failed":
                    self._protecting.pop(step, None)
                    self.event("ec failed", f"node {node}: protecting step {step} failed ({reason}); a node lost "
                                            f"now is rebuilt at an older step, if any", step)
                else:
                    nodes = self._protecting.setdefault(step, set())
                    nodes.add(r["source"]["node"])
                    if len(nodes) == self.nodes:
                        del self._protecting[step]
                        why = self._protect_reasons.pop(step, "")
                        self.event("protected", f"step {step} on every node (erasure-coded across its EC group): a "
                                                f"node lost from now on is rebuilt at step {step}"
                                   + (f" [protected because {why}]" if why else ""), step)
                        self.protected = (step, self.timeline.events[-1].t)

    def _inject(self, beats: dict) -> None:
        """One failure at a time: the next waits until training is back from the last (a rank stuck behind a lost
        node still shows the step it had reached)."""
        for f in self.failures:
            if f.fired or self._injected:
                continue
            watched = ([r for r, b in beats.items() if b["node"] == f.target] if f.kind == "node" else [f.target])
            if not watched or not all(beats.get(r, {}).get("step", -1) >= f.step for r in watched):
                continue
            f.fired = True
            # The supervisor polls: a fast trainer may be past the requested step when the signal lands.
            reached = max(beats[r]["step"] for r in watched)
            text = f.describe() + (f" (reached step {reached} when it landed)" if reached != f.step else "")
            self.timeline.failures.append((reached, text))
            self.event("failure", text, reached)
            self._injected.append((time.time(), text, f.kind))
            if f.kind == "rank":
                hangs.kill(beats[f.target]["pid"])
            elif f.kind == "hang":
                os.kill(beats[f.target]["pid"], signal.SIGSTOP)
            else:
                self._lose_node(f.target, [beats[r]["pid"] for r in watched])


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name before ")" may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _running(pid: int | None) -> bool:
    stat = _stat(pid) if pid else None
    return stat is not None and stat[0] not in ("Z", "X")


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`: torch starts each rank in a session of its own, out of reach of a killpg."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = _stat(int(entry)) if entry.isdigit() else None
        if stat:
            children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
