"""Several "nodes" on one machine: each its own SMP process, segment namespace and socket.

Losing a node here means what it means on a cluster: its trainer processes and its SMP die (SIGKILL)
and its memory is gone (its segments are unlinked). The tests and benchmarks run ranks on it directly, with
the torchrun variables set; `inmem-ft launch` runs an agent per node instead (supervisor.py).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..cluster.options import ECOptions
from ..smp import control, inventory, paths
from ..telemetry import read_record
from ..agent import worker
from ..agent.standbys import StandbyPool
from .ports import free_port

WORKERS = ("plain", "cold", "standby")


@dataclass
class Attempt:
    """One launch of every rank; `returncodes` maps rank -> exit code (negative: killed by that signal)."""

    number: int
    returncodes: dict[int, int]
    first_failure: int | None  # the rank whose exit (or hang) brought the attempt down
    seconds: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes.values())


class SimulatedCluster:
    def __init__(self, nodes: int, ranks_per_node: int, job: str, memory_budget: int, log_dir: str,
                 env: dict | None = None, parity: int | None = None, group_size: int | None = None,
                 ec_bandwidth: int | None = None, workers: str = "plain", hosts: list[str] | None = None,
                 smp_prefix: Callable[[int], list[str]] | None = None, smp_args: list[str] = ()):
        """Each SMP listens on a loopback TCP port of its own for its peers (cross-node reads), with the job
        secret INMEM_FT_SECRET of `env` or the environment (a fresh one if neither has it); `parity` m turns on
        erasure coding across the nodes. `workers`: "plain" runs each rank as `python argv...`, rank 0 serving
        the rendezvous store; "cold" runs it through inmem_ft.agent.worker, which records when it started and
        rendezvoused (worker_record), and serves the store from here, as torchrun's agent does; "standby" does
        too, and hands each rank to its slot's warm standby when there is one (start_standbys). `hosts`: each node's
        SMP address instead of loopback, and `smp_prefix(node)` the command its SMP runs under (a network namespace
        of its own holding that address: tests/netns.py). `smp_args`: more arguments for every SMP (e.g. the disk
        tier's --persist-dir)."""
        if workers not in WORKERS:
            raise ValueError(f"workers={workers!r}: expected one of {WORKERS}")
        self.nodes, self.ranks_per_node, self.job = nodes, ranks_per_node, paths.check_job(job)
        self.world_size = nodes * ranks_per_node
        self.memory_budget, self.log_dir = memory_budget, log_dir
        # As torchrun does: one intra-op thread per rank unless told otherwise; ranks share the cores.
        self.env = {"OMP_NUM_THREADS": "1", "INMEM_FT_SECRET": secrets.token_hex(16), **os.environ, **(env or {})}
        self.smps: dict[int, subprocess.Popen] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.attempts = 0
        self.placement: dict[int, int] | None = None  # rank -> node; None: node-major, as torchrun's static rdzv
        self.workers = workers
        self.standbys = StandbyPool(log_dir, logs=True) if workers == "standby" else None
        self.started_as: dict[int, str] = {}  # rank -> how this attempt started it: "standby", "cold" or "plain"
        self.failure = threading.Event()  # some rank of this attempt exited with an error
        self._store = None  # the running attempt's rendezvous store, when served from here
        os.makedirs(log_dir, exist_ok=True)
        self.hosts = hosts or ["127.0.0.1"] * nodes
        self.smp_prefix = smp_prefix or (lambda node: [])
        first = free_port(nodes)  # one block, reserved until this process exits: no two nodes share a port
        self.peers = ",".join(f"{n}={self.hosts[n]}:{first + n}" for n in range(nodes))
        self.ec = None if parity is None else ECOptions(parity, nodes, self.peers, group_size, bandwidth=ec_bandwidth)
        self.smp_args = [str(a) for a in smp_args]

    def reshape(self, nodes: int, ranks_per_node: int) -> None:
        """Later launches run `ranks_per_node` ranks on each of the first `nodes` nodes: the job back on
        another layout, with the SMPs (and snapshots) it had."""
        if not 1 <= nodes <= self.nodes:
            raise ValueError(f"a cluster of {self.nodes} nodes cannot launch on {nodes}")
        self.ranks_per_node, self.world_size = ranks_per_node, nodes * ranks_per_node

    def node_of(self, rank: int) -> int:
        return self.placement[rank] if self.placement else rank // self.ranks_per_node

    def socket_path(self, node: int) -> str:
        return paths.default_socket(self.job, node)

    # ---- SMPs ---------------------------------------------------------------------------------------------
    def smp_log(self, node: int) -> str:
        return os.path.join(self.log_dir, f"smp-node{node}.log")

    def start_smp(self, node: int) -> None:
        self.smps[node] = control.start(self.job, node, self.memory_budget, self.socket_path(node),
                                        self.smp_log(node),
                                        extra_args=[*(self.ec.argv() if self.ec else ["--peers", self.peers]),
                                                    *self.smp_args], env=self.env, prefix=self.smp_prefix(node))

    def start(self) -> "SimulatedCluster":
        """Start every node's SMP; if one fails, stop those already started and raise its error."""
        try:
            for node in range(self.nodes):
                self.start_smp(node)
        except BaseException:
            try:
                self.stop()
            except Exception as e:  # the start's error is the one to report; this one only follows it
                print(f"[inmem_ft] stopping the SMPs after a failed start: {e}", file=sys.stderr)
            raise
        return self

    def kill_smp(self, node: int) -> None:
        proc = self.smps.pop(node, None)
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def wipe_node(self, node: int) -> None:
        inventory.remove(self.job, node)

    def lose_node(self, node: int) -> None:
        for rank, proc in self.procs.items():
            if self.node_of(rank) == node and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        if self.standbys:
            self.standbys.stop([(node, local) for local in range(self.ranks_per_node)])
        self.kill_smp(node)
        self.wipe_node(node)

    def stop(self, wipe: bool = True) -> None:
        self.kill_ranks()
        if self.standbys:
            self.standbys.stop()
        for node in list(self.smps):
            try:
                control.stop(self.socket_path(node), wipe=wipe)
                self.smps[node].wait(timeout=10)
                del self.smps[node]
            except Exception:  # not stopped in time (or not answering): kill it, before its files are wiped
                self.kill_smp(node)
            if wipe:
                self.wipe_node(node)

    # ---- trainers ---------------------------------------------------------------------------------------
    def slot_of(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of `rank` under the current placement."""
        node = self.node_of(rank)
        return node, sorted(r for r in range(self.world_size) if self.node_of(r) == node).index(rank)

    def rank_vars(self, rank: int) -> dict:
        """The variables of `rank` that are the same in every attempt; launch() adds the attempt's own."""
        node, local = self.slot_of(rank)
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                "INMEM_FT_JOB": self.job, "INMEM_FT_NODE": str(node), "INMEM_FT_SMP_SOCKET": self.socket_path(node),
                "INMEM_FT_RUNTIME_DIR": paths.runtime_dir()}

    def launch(self, argv: list[str], extra_env: dict | None = None, placement: dict[int, int] | None = None) -> None:
        """Start every rank of one attempt running `python argv...` with the torchrun variables set.
        `placement` (rank -> node) puts global ranks on other nodes than last time, as torchrun's c10d
        rendezvous may after a re-queue."""
        self.attempts += 1
        self.placement = placement
        # New objects per attempt: a watcher of the last attempt that wakes late must not touch this one's.
        self.started_as, self.failure = {}, threading.Event()
        timed = self.workers != "plain" and worker.runnable(argv)
        store = self._agent_store() if timed else None
        port = store.port if store else free_port()
        for rank in range(self.world_size):
            env = {**self.env, **(extra_env or {}), **self.rank_vars(rank), "MASTER_PORT": str(port),
                   "INMEM_FT_ATTEMPT": str(self.attempts)}
            log = os.path.join(self.log_dir, f"attempt{self.attempts}-rank{rank}.log")
            if timed:
                env.update({worker.RECORD: self.record_path(self.attempts, rank),
                            "TORCHELASTIC_USE_AGENT_STORE": "True"})
            proc, how = None, "plain"
            if timed and self.standbys:
                # The log exists from the start whoever writes it: a standby opens it only once it takes over,
                # and a rank that fails before then (or a restart stopped first) still has one to read.
                open(log, "w").close()
                proc, how = self.standbys.hand_over(argv, env, log, log, slot=self.slot_of(rank)), "standby"
            if proc is None:
                command = ["-m", "inmem_ft.agent.worker", "--", *argv] if timed else argv
                how = "cold" if timed else "plain"
                with open(log, "w") as out:
                    proc = subprocess.Popen([sys.executable, *command], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.started_as[rank] = how
            self.procs[rank] = proc
            threading.Thread(target=self._watch, args=(proc, self.failure), daemon=True).start()

    def _agent_store(self):
        """A rendezvous store served from here, one per attempt, as torchrun's agent serves one (every rank a
        client: TORCHELASTIC_USE_AGENT_STORE). Were rank 0 serving it, a rank that asks before rank 0 is up
        would retry after a backoff (0.29 s for one 50 ms early, growing from there in torch 2.13): ranks
        restarted by warm standbys arrive within milliseconds of each other, and would wait for that."""
        from torch.distributed import TCPStore

        self._store = TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        return self._store

    @staticmethod
    def _watch(proc: subprocess.Popen, failure: threading.Event) -> None:
        """Wake whoever waits for a failure once the rank exits with one."""
        if proc.wait() != 0:
            failure.set()

    def record_path(self, attempt: int, rank: int) -> str:
        return os.path.join(self.log_dir, f"attempt{attempt}-rank{rank}.json")

    def worker_record(self, attempt: int, rank: int) -> dict | None:
        """What rank's worker recorded in `attempt` (inmem_ft.agent.worker); None if nothing (yet)."""
        return read_record(self.record_path(attempt, rank))

    def start_standbys(self) -> int:
        """Start a standby for every slot that has none, preloading what the slot's rank of the latest attempt
        has imported. Returns how many started; none before every rank has rendezvoused."""
        if not self.standbys or self.standbys.refused or not self.attempts or "plain" in self.started_as.values():
            return 0  # "plain": the command is not one the worker runs, so there is nothing to preload for it
        by_slot = {self.slot_of(rank): rank for rank in range(self.world_size)}
        missing = self.standbys.missing(list(by_slot))
        if not missing or any("modules" not in (self.worker_record(self.attempts, by_slot[s]) or {})
                              for s in missing):
            return 0
        for slot in missing:
            rank = by_slot[slot]
            self.standbys.start({**self.env, **self.rank_vars(rank)}, self.record_path(self.attempts, rank), slot)
        return len(missing)

    @property
    def starts(self) -> dict[str, int]:
        """How many ranks of this attempt started each way ("standby", "cold", "plain")."""
        return dict(Counter(self.started_as.values()))

    def failed_ranks(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() not in (None, 0)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def end_attempt(self, t0: float, first_failure: int | None = None) -> Attempt:
        """Stop what is left of the attempt (as torchrun does when a worker fails) and report it."""
        self.kill_ranks()
        if first_failure is None:
            first_failure = next((r for r, p in self.procs.items() if p.returncode != 0), None)
        attempt = Attempt(self.attempts, {r: p.returncode for r, p in self.procs.items()}, first_failure,
                          time.monotonic() - t0)
        self.procs, self._store = {}, None
        return attempt

    def wait(self, timeout_s: float = 600.0, poll: Callable[[float], None] | None = None) -> Attempt:
        """Wait for the attempt; the first rank to fail brings down the others. `poll(seconds so far)` runs
        while it waits (progress reports)."""
        t0 = time.monotonic()
        while self.running() and not self.failed_ranks() and time.monotonic() - t0 < timeout_s:
            if poll:
                poll(time.monotonic() - t0)
            self.failure.wait(0.05)
        failed = self.failed_ranks()
        return self.end_attempt(t0, failed[0] if failed else None)

    def run(self, argv: list[str], extra_env: dict | None = None, timeout_s: float = 600.0,
            placement: dict[int, int] | None = None, poll: Callable[[float], None] | None = None) -> Attempt:
        self.launch(argv, extra_env, placement)
        return self.wait(timeout_s, poll)

    def kill_ranks(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()

    def rank_log(self, attempt: int, rank: int) -> str:
        with open(os.path.join(self.log_dir, f"attempt{attempt}-rank{rank}.log"), errors="replace") as f:
            return f.read()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
