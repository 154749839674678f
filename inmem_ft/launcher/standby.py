"""Warm standby processes: one per rank slot (node, local rank), started ahead of a failure, that import what
the slot's rank has imported and then wait for a rank to run (inmem_ft/agent/worker.py).

A restart hands each rank to its slot's standby, also one still importing (it runs the rank once done: sooner
than a cold start, which would import everything again); a slot without a live standby starts cold. Standbys
of a lost node die with it, as on a real cluster. Each hand-over uses up a standby; the launcher starts new ones
when nothing is being recovered, so their imports never compete with a recovery for the CPU.

spawn, assign and refused are the process and its hand-over, also for the agent's standbys (agent/standbys.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from ..telemetry import read_record
from ..agent.worker import RECORD

Slot = tuple[int, int]  # (node, local rank)


def spawn(env: dict, previous_record: str, record: str, **popen) -> subprocess.Popen:
    """A standby process (agent/worker.py --standby) preloading what `previous_record`'s process imported and
    recording itself in `record`; unbuffered, as torchrun runs a rank (`python -u`). `popen`: where its output
    goes until it takes a rank, its session."""
    return subprocess.Popen([sys.executable, "-u", "-m", "inmem_ft.agent.worker", "--standby", previous_record],
                            env={**env, RECORD: record}, stdin=subprocess.PIPE, **popen)


def assign(proc: subprocess.Popen, argv: list[str], env: dict, stdout: str | None, stderr: str | None) -> bool:
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


class StandbyPool:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.procs: dict[Slot, tuple[subprocess.Popen, str]] = {}  # slot -> (process, its record)
        self.handed: list[str] = []  # records of the standbys that took a rank
        self.started = 0

    def start(self, slot: Slot, env: dict, previous_record: str) -> None:
        """A standby for `slot` with the slot's environment, preloading what `previous_record`'s process imported."""
        self.started += 1
        name = os.path.join(self.log_dir, f"standby{self.started}-node{slot[0]}-local{slot[1]}")
        with open(f"{name}.log", "w") as out:
            proc = spawn(env, previous_record, f"{name}.json", stdout=out, stderr=subprocess.STDOUT)
        self.procs[slot] = (proc, f"{name}.json")

    @property
    def refused(self) -> str | None:
        return refused(self.handed)

    def missing(self, slots: list[Slot]) -> list[Slot]:
        """The slots without a live standby."""
        for slot in slots:
            if slot in self.procs and self.procs[slot][0].poll() is not None:
                kill(self.procs.pop(slot)[0])
        return [slot for slot in slots if slot not in self.procs]

    def ready(self, slot: Slot) -> bool:
        """Whether the slot's standby is done importing and waits for a rank."""
        proc, record = self.procs.get(slot, (None, ""))
        return proc is not None and proc.poll() is None and bool((read_record(record) or {}).get("ready"))

    def hand_over(self, slot: Slot, argv: list[str], env: dict, log: str) -> subprocess.Popen | None:
        """The slot's standby, now given `argv` to run with `env` and `log`; None if there is none alive."""
        proc, record = self.procs.pop(slot, (None, ""))
        if proc is None or not assign(proc, argv, env, log, log):
            return None
        self.handed.append(record)
        return proc

    def stop(self, slots: list[Slot] | None = None) -> None:
        """Kill the standbys of `slots` (default: all)."""
        for slot in list(self.procs) if slots is None else slots:
            proc, _ = self.procs.pop(slot, (None, ""))
            if proc is not None:
                kill(proc)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
