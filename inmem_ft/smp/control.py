"""Start, stop and query a node's SMP daemon (used by the CLI, the launcher and the tests)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ..errors import SMPUnavailable
from . import paths
from .client import SMPClient


def ping(socket_path: str) -> dict | None:
    client = SMPClient(socket_path, timeout_s=5)
    try:
        return client.call("ping")
    except SMPUnavailable:
        return None
    finally:
        client.close()


def start(job: str, node: int, memory_budget: int, socket_path: str | None = None,
          log_path: str | None = None, wait_s: float = 30.0, extra_args: list[str] = (),
          env: dict | None = None, prefix: list[str] = ()) -> subprocess.Popen:
    """Start the daemon in its own session (it outlives the caller) and wait until it answers.
    `extra_args`: more daemon arguments, e.g. cluster.options.ECOptions.argv(); `prefix`: a command that runs it
    and execs it in turn (`ip netns exec NS`, `numactl -N 0`), so the process returned is still the daemon."""
    socket_path = socket_path or paths.default_socket(job, node)
    if ping(socket_path):
        raise SMPUnavailable(f"an SMP already serves {socket_path}; stop it first (`inmem-ft smp stop`)")
    paths.make_private_dir(os.path.dirname(socket_path))
    log_path = log_path or paths.default_log(job, node)
    log = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
    cmd = [*prefix, sys.executable, "-m", "inmem_ft.smp", "--job", job, "--node", str(node), "--socket", socket_path,
           "--memory-budget", str(memory_budget), *extra_args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            env=env)
    log.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ping(socket_path):
            return proc
        if proc.poll() is not None:
            raise SMPUnavailable(f"the SMP exited with code {proc.returncode} before it was ready: "
                                 f"{last_line(log_path)} (log: {log_path})")
        time.sleep(0.05)
    proc.kill()
    raise SMPUnavailable(f"the SMP did not answer on {socket_path} within {wait_s:.0f} s; see {log_path}")


def last_line(path: str) -> str:
    """A log's last line: where a process that stops on a setup error says why (the SMP's entry point turns
    every setup error into one such line; a traceback is a bug there)."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(its log is empty)"


def call(socket_path: str, op: str, **fields) -> dict:
    client = SMPClient(socket_path)
    try:
        return client.call(op, **fields)
    finally:
        client.close()


def status(job: str = "default", node: int = 0, socket_path: str | None = None) -> dict:
    """What `inmem-ft smp status --json` prints for the SMP of `job` on `node` (on this machine): raises
    SMPUnavailable when none answers. Times are seconds, sizes bytes; a step, age or lag not known yet is None.

    job, node, pid, uptime_s; budget and used (shared memory, parity included); complete_step: the newest step
    the trainers reported complete on every rank of the job; held_step: the newest step every rank that runs
    here holds committed, and held_age_s: how long ago its last rank committed it; ranks: [{rank, slots:
    [{slot, state ("committed", "writing", "empty"), step, bytes (data), capacity (segment size)}]}];
    counters since the SMP started: {commits, skipped, torn, corrupt, sentinel_trips, replica_mismatches};
    bad_steps: the steps a sentinel after a restore found bad (capture/sentinel.py) or whose replicas disagreed
    (capture/fingerprint.py), never listed for a restore again; ec (None without erasure coding):
    {group (this node's, [] while too few nodes are left for m), m, protected_step, degraded (why the newest
    steps are not protected against a node loss, or None), parity_steps, ec_lag_s (from complete to protected,
    of the newest protected step), parity_bytes, rebuilds, rebuild ("running", "ok" or why it failed)}; disk
    (None without a disk tier): {dir, every, flushed_step, flush_lag_s (from complete to on disk, of the last flush),
    flush_failures}; peers: [{node, addr, state ("up", "down" or "unknown": how the last call to it went)}];
    stale: the segments in shared memory that no running SMP serves, of any job (inventory.NodeSegments)."""
    from . import inventory  # it imports the daemon: only for this call, not for every user of control

    found = call(socket_path or paths.default_socket(job, node), "status")
    found["stale"] = inventory.stale_rows()
    return found


def flush(job: str = "default", node: int = 0, socket_path: str | None = None, timeout_s: float = 600.0) -> dict:
    """Put the job's newest complete step on disk on every node now, through the SMP of `job` on `node` (on this
    machine), and return once it is there: {step, nodes: {node: newest step on its disk}}. Raises InmemFTError
    saying why not (no disk tier, a node unreachable or failing to write, `timeout_s` passed), SMPUnavailable
    when no SMP answers."""
    client = SMPClient(socket_path or paths.default_socket(job, node), timeout_s=timeout_s + 60)
    try:
        return client.call("flush", timeout_s=timeout_s)
    finally:
        client.close()


def stop(socket_path: str, wipe: bool = False, wait_s: float = 10.0) -> None:
    call(socket_path, "shutdown", wipe=wipe)
    deadline = time.monotonic() + wait_s
    while os.path.exists(socket_path) and time.monotonic() < deadline:
        time.sleep(0.05)
