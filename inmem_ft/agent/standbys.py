"""Warm standbys: Python processes that have imported torch and what the node's ranks import (the framework, the
model's code) and wait to take a rank (worker.py's standby loop). A rank started on a standby skips the imports
(seconds per rank) and is otherwise what a cold start is: the command, its environment and its output files are
the launcher's.

Where the platform forks, a standby is a fork of the node's zygote (zygote.py), which imported everything once
and started before the first rendezvous: N standbys cost one import, and one used up by a restart is replaced at
once, the fork costing milliseconds and no imports that would compete with the restore for the cores. Where it
cannot fork (the zygote runs threads, touched CUDA, or the platform has no fork), each standby is its own
process importing everything (`python -m inmem_ft.agent.worker --standby`), and the launcher starts new ones only
once training runs again.

One pool serves both launchers: torch's agent (`inmem-ft run`, agent.py and handover.py) keeps `count` standbys,
any of which takes any of the node's ranks; the simulated cluster (launcher/simulated.py) starts one per slot
(node, local rank), whose standbys die with their node.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ..telemetry import read_record
from .worker import RECORD

CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"
Slot = tuple[int, int]  # (node, local rank)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def spawn(env: dict, previous_record: str, record: str, **popen) -> subprocess.Popen:
    """A standby process (worker.py --standby) preloading what `previous_record`'s process imported and
    recording itself in `record`; unbuffered, as torchrun runs a rank (`python -u`). `popen`: where its output
    goes until it takes a rank."""
    return subprocess.Popen([sys.executable, "-u", "-m", "inmem_ft.agent.worker", "--standby", previous_record],
                            env={**env, RECORD: record}, stdin=subprocess.PIPE, start_new_session=True, **popen)


def assign(proc, argv: list[str], env: dict, stdout: str | None, stderr: str | None) -> bool:
    """Hand the standby `proc` its rank: run `python argv...` with exactly `env`, its output into `stdout` and
    `stderr` (None: where the standby's own goes). False if it died meanwhile."""
    try:
        proc.stdin.write((json.dumps({"argv": argv, "env": env, "stdout": stdout, "stderr": stderr}) + "\n").encode())
        proc.stdin.close()
    except BrokenPipeError:
        kill(proc)
        return False
    return True


def refused(records: list[str]) -> str | None:
    """Why standbys cannot serve this job, once one of those that took a rank (their `records`) found out (it
    started the rank cold)."""
    return next((r["refused"] for r in map(read_record, records) if r and r.get("refused")), None)


def kill(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdin:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()


class Forked:
    """A standby a zygote forked, driven as torch's handler and the pool drive a subprocess.Popen: it is this
    process's child (the zygote's double fork orphans it, and this process is the children's subreaper)."""

    def __init__(self, pid: int, stdin):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The pool's end of one zygote process (zygote.py): requests go out at once, the forks' pids come back in
    order, collected when the pool next looks (the zygote answers once its current import is done)."""

    def __init__(self, env: dict, previous_record: str, out):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-u", "-m", "inmem_ft.agent.zygote", str(theirs.fileno()),
                                          previous_record], env=env, pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.devices = env.get(CUDA_DEVICES)
        self.pending: list[tuple] = []  # (stdin's write end, record, slot, what start() had) per request unanswered
        self.refused: str | None = None

    def follow(self, previous_record: str) -> None:
        """Import what `previous_record`'s process imports, from now on, whether or not a fork is asked for."""
        try:
            self.sock.send(json.dumps({"previous_record": previous_record}).encode())
        except OSError:
            self.refused = "the zygote is gone"

    def request(self, previous_record: str, record: str, out_fd: int, slot: Slot | None, start: tuple) -> None:
        r, w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps({"previous_record": previous_record, "record": record}).encode()],
                            [r, out_fd])
        except OSError:
            os.close(w)
            self.refused = "the zygote is gone"
            return
        finally:
            os.close(r)
        self.pending.append((os.fdopen(w, "wb", buffering=0), record, slot, start))

    def answers(self, wait: bool) -> list[Standby]:
        """The standbys forked since last asked; `wait`: for one at least, while the zygote lives and any is due.
        After a refusal the requests not forked stay pending (the pool spawns them)."""
        forked = []
        while self.pending and self.refused is None:
            timeout = 0.1 if wait and not forked else 0
            if not select.select([self.sock], [], [], timeout)[0]:
                if timeout and self.proc.poll() is None:
                    continue
                break
            message = self.sock.recv(4096)
            answer = json.loads(message) if message else {"refused": "the zygote is gone"}
            pid = answer.get("pid")
            if pid and not _is_child(pid):  # a kernel without child subreapers: not ours to wait for
                os.kill(pid, signal.SIGKILL)
                answer = {"refused": "a forked standby did not become this process's child (no child subreaper)"}
            if "pid" not in answer:
                self.refused = answer.get("refused", f"the zygote answered {answer}")
                break
            stdin, record, slot, _ = self.pending.pop(0)
            forked.append(Standby(Forked(pid, stdin), record, self.devices, slot))
        return forked

    def stop(self) -> None:
        for stdin, *_ in self.pending:
            stdin.close()
        self.pending = []
        self.sock.close()
        kill(self.proc)


@dataclass
class Standby:
    proc: subprocess.Popen | Forked
    record: str
    devices: str | None  # CUDA_VISIBLE_DEVICES it imported under (torch may cache what it saw then)
    slot: Slot | None  # the slot it serves (the simulated cluster's); None: any


class StandbyPool:
    def __init__(self, directory: str, count: int = 0, say: Callable[..., None] | None = None,
                 logs: bool = False, fork: bool = True):
        """Standbys recorded under `directory`; `count` of them kept by refill (the agent's pool). `say`: the
        launcher's log. `logs`: each standby's output until it takes a rank into its own file there (else where
        this process's goes). `fork`: from a zygote where the platform allows."""
        self.dir, self.count, self.logs = directory, count, logs
        self.say = say or (lambda event, text="", **fields: None)
        self.waiting: list[Standby] = []
        self.handed: list[str] = []  # records of the standbys that took a rank
        self.started = 0
        self.zygotes: dict[int | None, Zygote] = {}  # node (None: the agent's own) -> its zygote
        self.no_fork = None if fork and hasattr(os, "fork") and sys.platform == "linux" else "fork is off"
        self._said_ready = True

    # ---- starting ---------------------------------------------------------------------------------------
    @property
    def forks(self) -> bool:
        """Whether new standbys are forks (cheap, so refilled at once) rather than processes importing anew."""
        return self.no_fork is None

    def start_zygote(self, env: dict, previous_record: str = "", node: int | None = None) -> None:
        """`node`'s zygote, importing torch at once (before any rank has run) and following `previous_record`."""
        if not self.forks or node in self.zygotes:
            return
        os.makedirs(self.dir, exist_ok=True)
        if _become_subreaper():
            self.no_fork = "this process cannot become its children's subreaper"
            return
        with self._output(f"zygote-node{node}" if node is not None else "zygote") as out:
            self.zygotes[node] = Zygote(env, previous_record, out)
        self.say("zygote_started", pid=self.zygotes[node].proc.pid)

    def follow(self, previous_record: str) -> None:
        """The agent's zygote imports what `previous_record`'s process (a running rank) imports."""
        if None in self.zygotes:
            self.zygotes[None].follow(previous_record)

    def start(self, env: dict, previous_record: str, slot: Slot | None = None) -> None:
        """A standby (for `slot`) with `env`, preloading what `previous_record`'s process imported."""
        os.makedirs(self.dir, exist_ok=True)
        self.started += 1
        name = f"standby{self.started}" + (f"-node{slot[0]}-local{slot[1]}" if slot else "")
        record = os.path.join(self.dir, f"{name}.json")
        node = slot[0] if slot else None
        self.start_zygote(env, previous_record, node)
        zygote = self.zygotes.get(node)
        with self._output(name) as out:
            if zygote is not None:
                zygote.request(previous_record, record, out.fileno() if out else 1, slot, (env, previous_record, name))
                self._collect()
                return
        self._spawn(env, previous_record, name, slot)

    def _spawn(self, env: dict, previous_record: str, name: str, slot: Slot | None) -> None:
        with self._output(name) as out:
            proc = spawn(env, previous_record, os.path.join(self.dir, f"{name}.json"), stdout=out,
                         stderr=subprocess.STDOUT if out else None)
        self.waiting.append(Standby(proc, os.path.join(self.dir, f"{name}.json"), env.get(CUDA_DEVICES), slot))

    def refill(self, records: list[str]) -> int:
        """Start standbys until `count` wait, each preloading what the process of one of `records` (worker
        records of the running ranks) has imported; returns how many started. None once a standby found that the
        job's imports draw from torch's random generator (it then started its rank cold)."""
        self._drop_dead()
        why = refused(self.handed)
        have = len(self.waiting) + sum(len(z.pending) for z in self.zygotes.values())
        if why or not records or have >= self.count:
            if why and self.count:
                self.off(why)
            return 0
        new = self.count - have
        for _ in range(new):
            self.start(dict(os.environ), records[self.started % len(records)])
        self._said_ready = False
        self.say("standbys_started", count=new, waiting=len(self.waiting))
        return new

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def refused(self) -> str | None:
        return refused(self.handed)

    def available(self) -> bool:
        """Whether a standby waits or is being forked."""
        self._collect()
        return bool(self.waiting) or any(z.pending for z in self.zygotes.values())

    def missing(self, slots: list[Slot]) -> list[Slot]:
        """The slots without a live standby (waiting or being forked)."""
        self._drop_dead()
        due = {p[2] for z in self.zygotes.values() for p in z.pending}
        have = {s.slot for s in self.waiting} | due
        return [slot for slot in slots if slot not in have]

    def ready(self, slot: Slot) -> bool:
        """Whether the slot's standby is done importing and waits for a rank."""
        self._collect()
        return any(s.slot == slot and s.proc.poll() is None and _ready(s) for s in self.waiting)

    def say_when_ready(self) -> None:
        """One line once every waiting standby is done importing, with what each holds in memory."""
        self._collect()
        if (self._said_ready or not self.waiting or len(self.waiting) < self.count
                or not all(_ready(s) for s in self.waiting)):
            return
        self._said_ready = True
        rss = [_rss_mib(s.proc.pid) for s in self.waiting]
        self.say("standbys_ready", count=len(self.waiting), rss_mib=','.join(f'{r:.0f}' for r in rss))

    # ---- hand-over and the end -------------------------------------------------------------------------
    def hand_over(self, argv: list[str], env: dict, stdout: str | None, stderr: str | None,
                  slot: Slot | None = None):
        """A standby (of `slot`) now running `python argv...` with exactly `env`, its output into `stdout`,
        `stderr`: a ready one first, else one still importing or being forked (it runs the rank once done:
        sooner than a cold start, which imports everything again); None if there is none."""
        self._collect()
        while True:
            self._drop_dead()
            usable = [s for s in self.waiting if s.slot == slot and s.devices == env.get(CUDA_DEVICES)]
            for s in sorted(usable, key=lambda s: not _ready(s)):
                self.waiting.remove(s)
                if assign(s.proc, argv, env, stdout, stderr):
                    self.handed.append(s.record)
                    return s.proc
            due = [z for z in self.zygotes.values() if any(p[2] == slot for p in z.pending)
                   and z.devices == env.get(CUDA_DEVICES)]
            if not due:
                return None
            self._collect(wait=due[0])

    def stop(self, slots: list[Slot] | None = None) -> None:
        """Kill the standbys of `slots` and their nodes' zygotes (default: all)."""
        nodes = None if slots is None else {s[0] for s in slots}
        for node in [n for n in self.zygotes if nodes is None or n in nodes]:
            self.zygotes.pop(node).stop()
        for s in [s for s in self.waiting if slots is None or s.slot in slots]:
            kill(s.proc)
            self.waiting.remove(s)

    def off(self, why: str) -> None:
        """No standbys from now on: restarts start cold."""
        self.stop()
        self.count = 0
        self.say("standbys_off", text=why)

    def _collect(self, wait: Zygote | None = None) -> None:
        for node, zygote in list(self.zygotes.items()):
            self.waiting += zygote.answers(zygote is wait)
            if zygote.refused:
                self.no_fork = zygote.refused
                self.say("standbys_spawned", text=zygote.refused)
                unanswered = [(p[2], p[3]) for p in zygote.pending]
                zygote.stop()
                del self.zygotes[node]
                for slot, (env, previous_record, name) in unanswered:
                    self._spawn(env, previous_record, name, slot)

    def _drop_dead(self) -> None:
        for s in [s for s in self.waiting if s.proc.poll() is not None]:
            kill(s.proc)
            self.waiting.remove(s)

    @contextlib.contextmanager
    def _output(self, name: str):
        if not self.logs:
            yield None
            return
        with open(os.path.join(self.dir, f"{name}.log"), "w") as out:
            yield out


def _become_subreaper() -> int:
    """Make orphaned descendants this process's children (0), or say it cannot (an error number)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 else ctypes.get_errno() or 1


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def _ready(s: Standby) -> bool:
    return bool((read_record(s.record) or {}).get("ready"))


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        kib = 0
    return kib / 1024
