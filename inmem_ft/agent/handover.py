"""torch's LocalElasticAgent starting its ranks on the pool's warm standbys (standbys.py).

LocalElasticAgent._start_workers builds every rank's environment and log files and then calls `start_processes`
by its module-level name; while `onto(pool)` is active that name builds torch's SubprocessContext with one
change, that each rank's SubprocessHandler gets its process from a standby instead of a new Popen. torch's poll,
pids, close and signal handling then work on them unchanged: a standby runs in its own session, as torch's
subprocesses do, and once handed a rank it is that rank's process.
"""
from __future__ import annotations

import contextlib
import sys

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

from .standbys import StandbyPool
from .worker import runnable

WORKER = "inmem_ft.agent.worker"


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
        command = standby_command(list(args))
        proc = command and self._pool.hand_over(command, env, _name(self._stdout), _name(self._stderr))
        if proc is None:
            return super()._popen(args, env)
        self.from_standby = True
        return proc


def standby_command(argv: list[str]) -> list[str] | None:
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

