"""The node's SMP for the length of an agent's run: started (or an SMP of the same job and node that outlived an
earlier launcher reused) before the first ranks, started again should it die, stopped when the run ends. This is
the only place that starts and stops a node's SMP for a job (the launch scripts exec `inmem-ft run`). Its
snapshots stay in shared memory after a failure or a stop from outside, for a re-queued job; a new SMP adopts what
a dead one left there."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..errors import SMPUnavailable
from ..smp import control

SECRETS = ("INMEM_FT_SECRET", "INMEM_FT_SECRET_FILE")


class NodeSMP:
    def __init__(self, job: str, node: int, socket: str, memory_budget: str | None, extra_args: list[str], say):
        self.job, self.node, self.socket, self.budget, self.extra, self.say = (job, node, socket, memory_budget,
                                                                               extra_args, say)
        self.pid: int | None = None
        self._starting: subprocess.Popen | None = None  # `inmem-ft smp start` while it runs (begin, ready)
        self.stopped = False  # stopped once: at a signal, before torch stops the ranks, and not again at the end
        # The per-job secret goes to the SMP alone: it leaves this process's environment, which the ranks inherit.
        self._secrets = {k: os.environ.pop(k) for k in SECRETS if k in os.environ}

    def start(self) -> None:
        """Start it through `inmem-ft smp start` (its options, EC included, checked there) and wait until it
        answers."""
        self.begin()
        self.ready()

    def begin(self) -> None:
        """Start it without waiting (after a dead SMP: it comes up while the ranks stop and the agents rendezvous,
        which take as long as its imports; the ranks need it only once they start, `ready()`)."""
        found = control.ping(self.socket)
        if found:
            self.pid = found.get("pid")
            self.say("smp_reused", socket=self.socket)
            return
        if not self.budget:
            raise SMPUnavailable("no SMP serves this job and node: give --memory-budget (or "
                                 "INMEM_FT_MEMORY_BUDGET), the shared memory it may use, e.g. 64GiB")
        cmd = [sys.executable, "-m", "inmem_ft", "smp", "start", "--job", self.job, "--node", str(self.node),
               "--socket", self.socket, "--memory-budget", self.budget, *self.extra]
        self.pid = None  # none to watch until it answers
        self._starting = subprocess.Popen(cmd, env={**os.environ, **self._secrets}, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ready(self) -> None:
        """Wait for the SMP `begin()` started, if one is starting: it answers, or SMPUnavailable says why not."""
        proc, self._starting = self._starting, None
        if proc is None:
            return
        waited = time.monotonic()
        out = " | ".join(line for line in proc.communicate()[0].splitlines() if line.strip())
        waited = time.monotonic() - waited
        if proc.returncode != 0:
            raise SMPUnavailable(f"the SMP did not start: {out}")
        found = control.ping(self.socket)  # started means it answers; it says its own pid, no need to parse output
        self.pid = found.get("pid") if found else None
        self.say("smp_started", pid=self.pid, socket=self.socket, waited_s=f"{waited:.3f}")

    def alive(self) -> bool:
        """Whether the SMP this agent started or reused still runs (a look at /proc: cheap enough for every
        poll, and never blocked by an SMP that is slow to answer)."""
        return self.pid is None or _state(self.pid) not in ("", "Z", "X")

    def stop(self, wipe: bool, signalled: bool, reason: str = "") -> None:
        """Stopped from outside (a preemption, scancel): SIGTERM, on which the SMP first spills its newest complete
        step to its spill directory, if it has one, and only then `wipe`. Otherwise it is asked to shut down.
        `reason` (why it wipes) goes into the log line."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.ready()  # one still starting is stopped too, not left to outlive the run
        except SMPUnavailable as e:
            self.say("smp_not_started", text=str(e))
            return
        if control.ping(self.socket) is None:
            self.say("smp_gone")
            return
        if signalled and self.pid:
            os.kill(self.pid, signal.SIGTERM)
            while os.path.exists(f"/proc/{self.pid}") and _state(self.pid) != "Z":
                time.sleep(0.1)
            if wipe:  # only now that it has spilled
                from ..smp import inventory  # it imports the daemon: only here

                inventory.remove(self.job, self.node)
            self.say("smp_stopped", wiped=int(wipe), by="SIGTERM", pid=self.pid)
            return
        control.stop(self.socket, wipe=wipe)
        self.say("smp_stopped", wiped=int(wipe), **({"reason": reason} if reason else {}))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split()[1] for line in f if line.startswith("State:")), "")
    except OSError:
        return ""
