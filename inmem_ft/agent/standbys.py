"""Warm standbys for `inmem-ft run`: Python processes that have imported torch and what the node's ranks import
(the framework, the model's code) and wait to take a rank (agent/worker.py --standby). torch's agent restarts
every local rank of the node on a failure; a rank started on a standby skips the imports (seconds per rank) and
is otherwise what a cold start is: torchrun's command, its environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, ...) and its stdout/stderr files, from torch's own code.

How it sits in torch's agent: LocalElasticAgent._start_workers builds every rank's environment and log files and
then calls `start_processes` by its module-level name; while `onto(pool)` is active that name builds torch's
SubprocessContext with one change, that each rank's SubprocessHandler gets its process from a standby instead of
a new Popen. torch's poll, pids, close and signal handling then work on them unchanged: a standby runs in its own
session, as torch's subprocesses do, and once handed a rank it is that rank's process.

The pool is refilled by the agent once training runs again, so the imports of new standbys never compete with a
start or a restore for the CPU.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

from ..launcher import standby
from .worker import runnable
from ..telemetry import read_record

WORKER = "inmem_ft.agent.worker"
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass
class Standby:
    proc: subprocess.Popen
    record: str
    devices: str | None  # CUDA_VISIBLE_DEVICES it imported under (torch may cache what it saw then)


class StandbyPool:
    def __init__(self, count: int, directory: str, say):
        """`count` standbys at most, their records under `directory`; `say`: the agent's log."""
        self.count, self.dir, self.say = count, directory, say
        self.waiting: list[Standby] = []
        self.handed: list[str] = []  # records of the standbys that took a rank
        self.started = 0
        self._said_ready = True

    def refill(self, records: list[str]) -> int:
        """Start standbys until `count` wait, each preloading what the process of one of `records` (worker
        records of the running ranks) has imported; returns how many started. None once a standby found that the
        job's imports draw from torch's random generator (it then started its rank cold)."""
        self._drop_dead()
        why = standby.refused(self.handed)
        if why or not records or len(self.waiting) >= self.count:
            if why and self.count:
                self.off(why)
            return 0
        os.makedirs(self.dir, exist_ok=True)
        new = self.count - len(self.waiting)
        for _ in range(new):
            self.started += 1
            record = os.path.join(self.dir, f"standby{self.started}.json")
            # Output until it takes a rank goes where the agent's does (one line: what it preloaded, how long).
            proc = standby.spawn(dict(os.environ), records[(self.started - 1) % len(records)], record,
                                 start_new_session=True)
            self.waiting.append(Standby(proc, record, os.environ.get(CUDA_DEVICES)))
        self._said_ready = False
        self.say("standbys_started", count=new, waiting=len(self.waiting))
        return new

    def off(self, why: str) -> None:
        """No standbys from now on: restarts start cold."""
        self.stop()
        self.count = 0
        self.say("standbys_off", text=why)

    def say_when_ready(self) -> None:
        """One line once every waiting standby is done importing, with what each holds in memory."""
        if self._said_ready or not self.waiting or not all(_ready(s) for s in self.waiting):
            return
        self._said_ready = True
        rss = [_rss_mib(s.proc.pid) for s in self.waiting]
        self.say("standbys_ready", count=len(self.waiting), rss_mib=','.join(f'{r:.0f}' for r in rss))

    def hand_over(self, argv: list[str], env: dict, stdout: str | None, stderr: str | None) -> subprocess.Popen | None:
        """A standby now running `python argv...` (torchrun's command for a rank) with `env` and its output into
        `stdout`, `stderr`; a ready one first, else one still importing (it runs the rank once done: sooner than
        a cold start, which imports everything again); None if there is none or the command is not one a
        standby can run (the agent then starts the rank cold)."""
        command = _worker_command(argv)
        if command is None:
            return None
        self._drop_dead()
        usable = [s for s in self.waiting if s.devices == env.get(CUDA_DEVICES)]
        for s in sorted(usable, key=lambda s: not _ready(s)):
            self.waiting.remove(s)
            if standby.assign(s.proc, command, env, stdout, stderr):
                self.handed.append(s.record)
                return s.proc
        return None

    def stop(self) -> None:
        for s in self.waiting:
            standby.kill(s.proc)
        self.waiting = []

    def _drop_dead(self) -> None:
        for s in [s for s in self.waiting if s.proc.poll() is not None]:
            standby.kill(s.proc)
            self.waiting.remove(s)


@contextlib.contextmanager
def onto(pool: StandbyPool):
    """Within this block torch's LocalElasticAgent._start_workers starts its ranks on `pool`'s standbys (each
    rank for which there is none starts cold, as torch does). torch offers no other way in: it builds the
    environments and logs in that method and calls start_processes by the name this swaps."""
    original = local_elastic_agent.start_processes

    def start_processes(*, entrypoint, start_method="spawn", **kwargs):
        if not isinstance(entrypoint, str):  # a Python function, not torchrun's command: torch's own
            return original(entrypoint=entrypoint, start_method=start_method, **kwargs)
        context = _Context(pool, entrypoint=entrypoint, **kwargs)
        try:
            context.start()
            return context
        except Exception:
            context.close()
            raise

    local_elastic_agent.start_processes = start_processes
    try:
        yield
    finally:
        local_elastic_agent.start_processes = original


def from_standbys(pcontext) -> int:
    """How many ranks of a process context `onto` built were handed to standbys."""
    return sum(getattr(h, "from_standby", False) for h in getattr(pcontext, "subprocess_handlers", {}).values())


class _Context(SubprocessContext):
    """torch's SubprocessContext, its handlers _Handler."""

    def __init__(self, pool: StandbyPool, **kwargs):
        super().__init__(**kwargs)
        self._pool = pool

    def _start(self):  # SubprocessContext._start, with _Handler for get_subprocess_handler
        if self.subprocess_handlers:
            raise ValueError("The subprocess handlers already initialized. Most likely the start method got called "
                             "twice.")
        numa = {"numa_options": self._numa_options} if hasattr(self, "_numa_options") else {}
        self.subprocess_handlers = {
            local_rank: _Handler(self._pool, entrypoint=self.entrypoint, args=self.args[local_rank],
                                 env=self.envs[local_rank], stdout=self.stdouts[local_rank],
                                 stderr=self.stderrs[local_rank], local_rank_id=local_rank, **numa)
            for local_rank in range(self.nprocs)}


class _Handler(SubprocessHandler):
    """torch's handler of one rank's process (it opens the rank's log files and builds its environment as for a
    cold start), the process being a standby handed the rank where there is one."""

    def __init__(self, pool: StandbyPool, **kwargs):
        self._pool, self.from_standby = pool, False
        super().__init__(**kwargs)

    def _popen(self, args, env):
        proc = self._pool.hand_over(list(args), env, _name(self._stdout), _name(self._stderr))
        if proc is None:
            return super()._popen(args, env)
        self.from_standby = True
        return proc


def _worker_command(argv: list[str]) -> list[str] | None:
    """What a standby runs of torchrun's `python -u -m inmem_ft.agent.worker -- COMMAND...` (COMMAND), or
    None for any other command (another interpreter, a NUMA wrapper, --no-python)."""
    if not argv or argv[0] != sys.executable:
        return None
    rest = argv[1:][1:] if argv[1:2] == ["-u"] else argv[1:]
    if rest[:3] != ["-m", WORKER, "--"] or not runnable(rest[3:]):
        return None
    return rest[3:]


def _name(stream) -> str | None:
    return stream.name if stream is not None else None


def _ready(s: Standby) -> bool:
    return bool((read_record(s.record) or {}).get("ready"))


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        kib = 0
    return kib / 1024
