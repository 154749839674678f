"""torch's elastic agent (what torchrun runs), with what inmem_ft adds on each node: the node's SMP for the length
of the run, hung ranks found by their heartbeats (stacks dumped, then killed: a crash from there on), warm
standby processes the restarted ranks start on (standbys.py, handover.py), and the time each failure costs (clock.py).
Restarts are torch's own: every local rank stops, the agents rendezvous again, every rank starts anew (on a
standby where one waits) and restores from the SMPs. With a node range (--nnodes MIN:MAX) a lost node that no
node replaces within the spare wait is trained without, and a node that joins is taken in at the next snapshot:
the ranks then restore onto the new data-parallel size, resharded from memory (docs/agent.md, "Elastic").
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from .. import events, telemetry
from ..errors import SPARE_EXIT, STOP_EXIT
from ..smp import control
from .worker import RECORD_DIR
from . import hangs, lines, membership, rendezvous, sparewait
from .clock import RecoveryClock
from .node_smp import NodeSMP
from .handover import from_standbys, onto
from .standbys import StandbyPool

KILL_WAIT_S = 5.0  # how long a killed hung rank may take to be seen gone by the process context


@dataclass
class AgentOptions:
    job: str
    node: int
    socket: str
    memory_budget: str | None
    smp_args: list[str]
    hang_timeout_s: float  # 0: off
    dump_wait_s: float
    work_dir: str
    wipe_on_exit: str  # finished, 1 or 0
    standbys: int | None = None  # warm standby processes; None: one per local rank
    rdzv_poll_s: float | None = None  # None: scaled with the number of nodes (rendezvous.py)
    nodes: tuple[int, int] = (1, 1)  # --nnodes MIN, MAX
    spare_wait_s: int = 0  # with MIN < MAX: how long the survivors of a node loss wait for a node to replace it


class InmemAgent(LocalElasticAgent):
    def __init__(self, *args, options: AgentOptions, **kwargs):
        super().__init__(*args, **kwargs)
        self.opts = options
        self.smp = NodeSMP(options.job, options.node, options.socket, options.memory_budget, options.smp_args,
                           lines.sayer("launch", options.node))
        self.events = os.environ.get(events.EVENTS) or os.path.join(options.work_dir, events.FILE)
        self.clock = RecoveryClock(os.path.join(options.work_dir, "time_lost.json"), self.say, self.events)
        self._attempt = 0
        self._hb_dir = ""
        self._alive_at: float | None = None  # the last poll that found every local rank running
        self._nodes_now: int | None = None  # nodes in the last rendezvous
        self._members: list[int] | None = None  # with a node range: the SMP node ids of the last rendezvous
        count = options.standbys if options.standbys is not None else self._worker_group.spec.local_world_size
        self.standbys = StandbyPool(os.path.join(options.work_dir, "standbys"), count, self.say) if count else None
        self._poll = rendezvous.scale_polling(self._worker_group.spec.rdzv_handler, options.rdzv_poll_s)
        rendezvous.skew_first_join_only(self._worker_group.spec.rdzv_handler)
        self._joining_after: int | None = None  # with a node waiting to join: the last snapshot when it came
        self._last_beats: dict[int, dict] = {}  # the local ranks' heartbeats at the last poll
        self._last_call: rendezvous.LastCall | None = None  # with a node range: each round's wait for a spare
        self._spare_needed = False  # a rank exited with SPARE_EXIT: the next restart waits for a node to join
        self._waiting = self._worker_group.spec.rdzv_handler.num_nodes_waiting  # torch's, before _joins_at_snapshots
        if options.nodes[0] < options.nodes[1]:
            self._joins_at_snapshots(self._worker_group.spec.rdzv_handler)
            self._last_call = rendezvous.LastCall(self._worker_group.spec.rdzv_handler)

    def say(self, event: str, text: str = "", sep: str = ": ", **fields) -> None:
        """One `[inmem_ft] agent node=N event=...` line in the job's log, and its record in the events file."""
        lines.say("agent", self.opts.node, event, text, sep, **fields)

    def run(self, *args, **kwargs) -> RunResult:
        os.makedirs(self.opts.work_dir, mode=0o700, exist_ok=True)
        os.environ[events.EVENTS] = self.events  # this process's, its SMP's and its ranks' (they inherit it)
        if self._poll:
            poll, nodes = self._poll
            self.say("rdzv_poll", poll_s=poll, nodes=nodes, text=f"the rendezvous reads its store every "
                     f"{poll * 1000:g} ms while it waits (torch's own: every {rendezvous.MAX_S:g} s)")
        low, high = self.opts.nodes
        if low < high:
            self.say("elastic", nodes=f"{low}:{high}", spare_wait_s=self.opts.spare_wait_s,
                     text=f"a lost node that no node replaces within {self.opts.spare_wait_s} s is trained without "
                          f"(down to {low} nodes), the state resharded from memory; a node that joins is taken in")
        self.smp.start()
        os.environ.update({"INMEM_FT_JOB": self.opts.job, "INMEM_FT_NODE": str(self.opts.node),
                           "INMEM_FT_SMP_SOCKET": self.opts.socket})
        if self.standbys:  # the zygote imports torch while the agents rendezvous and the first ranks start
            self.standbys.start_zygote(dict(os.environ))
        result, signalled = None, False
        try:
            result = super().run(*args, **kwargs)
            return result
        except SignalException:
            signalled = True
            raise
        finally:
            self.clock.close()
            if self.standbys:
                self.standbys.stop()
            self._stop_smp(result is not None and result.state == WorkerState.SUCCEEDED, signalled)

    def _invoke_run(self, *args, **kwargs) -> RunResult:
        try:
            return super()._invoke_run(*args, **kwargs)
        except SignalException as e:
            # Stopped from outside (preemption, scancel, requeue, time limit): the SMP spills at once, before
            # torch stops the ranks, which can take longer than the grace time before SIGKILL; the snapshots in
            # memory are whole already.
            self.smp.say("signal", sig=signal.Signals(e.sigval).name.removeprefix('SIG'))
            self._stop_smp(False, True)
            raise

    def _stop_smp(self, finished: bool, signalled: bool) -> None:
        """The wipe-on-exit rule: a run that finished (its ranks succeeded, no signal) leaves nothing to resume
        from, so its snapshots are released; after a failure or a signal they stay for a re-queued job."""
        rule = self.opts.wipe_on_exit
        by_rule = rule == "finished" and finished and not signalled
        self.smp.stop(rule == "1" or by_rule, signalled, reason="finished" if by_rule else "")

    # ---- torch's hooks ------------------------------------------------------------------------------------
    def _start_workers(self, worker_group, *args, **kwargs):
        self._attempt += 1
        attempt_dir = os.path.join(self.opts.work_dir, f"attempt{self._attempt}")
        self._hb_dir = os.path.join(attempt_dir, "heartbeats")
        os.makedirs(self._hb_dir, exist_ok=True)
        # Every local rank inherits this process's environment; per-rank paths are derived from RANK.
        os.environ.update({telemetry.HEARTBEAT_DIR: self._hb_dir, RECORD_DIR: attempt_dir})
        # New ranks need their SMP: one started after a dead SMP may still be coming up (its wait, if any, counts
        # in the time lost's "agent rendezvous", the part before the ranks start; its line says how long).
        self.smp.ready()
        launched_at = time.time()
        self._say_resized(worker_group, launched_at)
        if self.opts.nodes[0] < self.opts.nodes[1]:  # before the ranks: their first snapshot is protected by them
            self._members = membership.regroup(worker_group, self.opts.node, self.opts.socket, self.say)
        with self._onto_standbys():
            pids = super()._start_workers(worker_group, *args, **kwargs)
        self._say_started(worker_group)
        self._alive_at = None
        records = {w.global_rank: os.path.join(attempt_dir, f"rank{w.global_rank}.json") for w in worker_group.workers}
        self.clock.launched(self._attempt, launched_at, records)
        if self.standbys:  # the zygote imports what a rank imports as the rank does; forks replace those used
            self.standbys.follow(records[min(records)])
            self._refill_standbys(worker_group, {})
        return pids

    def _stop_workers(self, worker_group, *args, **kwargs):
        super()._stop_workers(worker_group, *args, **kwargs)
        self.clock.stopped(self._beats(worker_group))

    def _restart_workers(self, worker_group, *args, **kwargs):
        if not self.clock.pending:  # this node's ranks are well: another node's agent asked for a new round
            self.clock.failed("a peer node asked for a new rendezvous round", self._beats(worker_group),
                              failed_at=time.time(),
                              note="the failure was on another node: counted from this node's notice of it")
        if self._spare_needed:
            self._spare_needed = False
            sparewait.wait(self._waiting, self.say)
        super()._restart_workers(worker_group, *args, **kwargs)

    def _monitor_workers(self, worker_group, *args, **kwargs) -> RunResult:
        polled_at = time.time()
        result = super()._monitor_workers(worker_group, *args, **kwargs)
        beats = self._last_beats = self._beats(worker_group)
        if not self.smp.alive():
            lost = self.smp.pid
            self.say("smp_lost", pid=lost, text="starting a new one, then restarting the ranks")
            # It comes up while the ranks stop and the agents rendezvous; _start_workers waits for it (ready) and,
            # with a node range, tells it the round's nodes (membership.regroup) before the ranks start.
            self.smp.begin()
            if result.state == WorkerState.HEALTHY:
                return self._recover_smp(worker_group, beats, lost)
        if result.state == WorkerState.HEALTHY:
            self._alive_at = polled_at
            self.clock.poll(beats)
            self._refill_standbys(worker_group, beats)
            hung = hangs.stale(beats, time.time(), self.opts.hang_timeout_s) if self.opts.hang_timeout_s else []
            if hung:
                return self._recover_hang(worker_group, beats, hung)
        elif result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._standbys_off_if_they_failed(result)
            stopped = sorted(r for r, f in result.failures.items() if f.exitcode == STOP_EXIT)
            if stopped:  # a restart cannot help (restored states went bad twice in a row): the job fails now
                self._remaining_restarts = 0
                self.say("job_stopped", ranks=",".join(map(str, stopped)), text=f"rank {stopped[0]} exited with "
                         f"{STOP_EXIT}, which asks not to be restarted (its log says why); the job stops")
            # The job cannot go on at this node count (on_shrink "refuse"): restarted once a node joins.
            self._spare_needed = self.opts.nodes[0] < self.opts.nodes[1] and any(
                f.exitcode == SPARE_EXIT for f in result.failures.values())
            seen = "a crash comes after the last poll that found every rank alive: counted from there"
            self.clock.failed(_describe(result), beats, self._alive_at, seen if self._alive_at else "")
        return result

    # ---- warm standbys -----------------------------------------------------------------------------------
    def _onto_standbys(self):
        """The ranks start on standbys (those there are; the rest cold, as torch starts them)."""
        if not self.standbys or not self.standbys.available():
            return contextlib.nullcontext()
        return onto(self.standbys)

    def _standbys_off_if_they_failed(self, result: RunResult) -> None:
        """The first rank to fail of a restart on standbys, before training got back, failed on its own (an
        exception, not a signal): most likely the command's imports depend on what it does before them (a patch
        that must precede an import), which a standby has imported already. Cold starts from now on; the job goes
        on."""
        if not (self.standbys and self.standbys.count and self.clock.pending and from_standbys(self._pcontext)
                and result.failures):
            return
        first = min(result.failures.values(), key=lambda f: f.timestamp)
        if first.exitcode > 0:
            log = self._pcontext.stderrs.get(first.local_rank)
            said = control.last_line(log) if log and os.path.exists(log) else ""
            self.standbys.off(f"local rank {first.local_rank}, started on a standby, exited with {first.exitcode} "
                              f"before training got back (its imports may have to follow its own code)"
                              + (f": {said}" if said else ""))

    def _say_resized(self, worker_group, launched_at: float) -> None:
        """The rendezvous settled on another node count than the last: the ranks restore onto the new data-parallel
        size from memory (the restore line says from which layout to which), and the restart's time lost is
        split with the round's wait for a spare (until the round completed, which the maximum of nodes may end
        early)."""
        waited = self._last_call.take() if self._last_call else None
        nodes, before = worker_group.group_world_size, self._nodes_now
        self._nodes_now = nodes
        low, high = self.opts.nodes
        if before is None and low < high:  # the start is over: a round from now on replaces a lost node
            spare = self.opts.spare_wait_s
            if not rendezvous.set_last_call(worker_group.spec.rdzv_handler, spare):
                self.say("spare_wait_unset", text="this torch's rendezvous keeps its last-call wait elsewhere; a lost "
                                                  "node is waited for as long as --rdzv-conf last_call_timeout says (30 s)")
        if before is not None and nodes != before:
            how = "shrink" if nodes < before else "grow"
            self.say(how, nodes=f"{before}->{nodes}", world_size=worker_group.spec.local_world_size * nodes,
                     text=f"the ranks restart at {nodes} nodes and reshard the newest complete step from memory")
            self.clock.resized(how, f"{before}->{nodes}",
                               (min(waited[0], launched_at), min(waited[1], launched_at)) if waited else None)

    def _joins_at_snapshots(self, handler) -> None:
        """torch's agent restarts the ranks as soon as its rendezvous has a node waiting (a grow); here a waiting
        node counts once every local rank has taken a snapshot after it came and stepped past it, so the restart
        loses next to no training: every rank reshards that step onto the larger size. Where the ranks report no
        snapshot (none taken yet, no inmem_ft) it counts at once, as under torch. Read from the heartbeats this
        agent polls anyway: nothing here waits on the SMP."""
        waiting = handler.num_nodes_waiting

        def at_snapshot() -> int:
            count = waiting()
            if not count:
                self._joining_after = None
                return 0
            beats = list(self._last_beats.values())
            taken = min((b.get("snapshot_step") for b in beats), default=None) if all(
                "snapshot_step" in b for b in beats) else None
            if self._joining_after is None:
                self._joining_after = -1 if taken is None else taken
                self.say("node_waiting", count=count,
                         text=f"taken in once the ranks are past their next snapshot (the last one taken: step {taken})")
            if taken is None or (taken > self._joining_after and all(b.get("step", -1) > taken for b in beats)):
                return count
            return 0

        handler.num_nodes_waiting = at_snapshot

    def _say_started(self, worker_group) -> None:
        warm = from_standbys(self._pcontext)
        self.say("ranks_started", attempt=self._attempt, from_standby=warm, cold=len(worker_group.workers) - warm)

    def _refill_standbys(self, worker_group, beats: dict[int, dict]) -> None:
        """Top the standbys up, each preloading what one of the running ranks imported (its worker record): first
        once every local rank beats and no restart is being timed (training runs: what it imports is known, and
        imports do not compete with a start or a restore for the cores); after a restart used some, at once where
        they are the zygote's forks (a second failure finds them warm, and a fork costs milliseconds)."""
        if not self.standbys:
            return
        if (self.standbys.forks and self.standbys.handed) or (len(beats) == len(worker_group.workers)
                                                              and not self.clock.pending):
            attempt_dir = os.path.join(self.opts.work_dir, f"attempt{self._attempt}")
            self.standbys.refill([os.path.join(attempt_dir, f"rank{w.global_rank}.json")
                                  for w in worker_group.workers])
        self.standbys.say_when_ready()

    # ---- hangs --------------------------------------------------------------------------------------------
    def _recover_hang(self, worker_group, beats: dict[int, dict], hung: list[int]) -> RunResult:
        """Dump the hung ranks' stacks into their logs and the agent's, kill them, and hand torch an ordinary
        failed rank (so that a hang past the last restart fails the job, as a crash does)."""
        now = time.time()
        local = {w.global_rank: w.local_rank for w in worker_group.workers}
        what = ", ".join(f"rank {r} at step {beats[r].get('step', 0)}, last beat {now - beats[r]['time']:.1f} s ago"
                         for r in hung)
        cause = f"no heartbeat for over {self.opts.hang_timeout_s:g} s from rank(s) {hung} (hung: {what})"
        self.clock.failed(cause, beats, failed_at=min(beats[r]["time"] for r in hung),
                          note="a hung rank hangs after its last heartbeat: counted from that beat")
        self.say("hang", ranks=",".join(map(str, hung)), timeout_s=self.opts.hang_timeout_s, text=what)
        logs = self._pcontext.stderrs
        stacks = hangs.dump_and_kill({beats[r]["pid"]: logs.get(local[r], "") for r in hung}, self.opts.dump_wait_s)
        for r in hung:
            stack = stacks[beats[r]["pid"]]
            self.say("hang_stack", rank=r, pid=beats[r]["pid"], text=stack or "(no stack came: see its log)", sep=":\n")
        return self._failed_result(worker_group)

    def _failed_result(self, worker_group) -> RunResult:
        """What torch's monitor says once the killed ranks are gone: an ordinary failure."""
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.HEALTHY or time.monotonic() > deadline:
                return result if result.state != WorkerState.HEALTHY else RunResult(state=WorkerState.UNHEALTHY)
            time.sleep(0.05)

    # ---- the SMP ------------------------------------------------------------------------------------------
    def _recover_smp(self, worker_group, beats: dict[int, dict], lost: int) -> RunResult:
        """The node's SMP died under running ranks and a new one adopted the snapshots the dead one left in shared
        memory: the ranks, whose connections died with it, restart (killed here: a crash for torch)."""
        self.clock.failed(f"the node's SMP (pid {lost}) died", beats, self._alive_at,
                          "the SMP died after the last poll that found it running: counted from there")
        for pid in self._pcontext.pids().values():
            hangs.kill(pid)
        return self._failed_result(worker_group)

    def _beats(self, worker_group) -> dict[int, dict]:
        if self._pcontext is None or not self._hb_dir:
            return {}
        by_local = self._pcontext.pids()
        pids = {w.global_rank: by_local.get(w.local_rank) for w in worker_group.workers}
        return hangs.beats_of(self._hb_dir, pids)


def _describe(result: RunResult) -> str:
    if not result.failures:
        return f"the worker group became {result.state.name}"
    return "; ".join(f"rank {rank} exited with {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
                     for rank, f in sorted(result.failures.items()))
