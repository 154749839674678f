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


def stop(socket_path: str, wipe: bool = False, wait_s: float = 10.0) -> None:
    call(socket_path, "shutdown", wipe=wipe)
    deadline = time.monotonic() + wait_s
    while os.path.exists(socket_path) and time.monotonic() < deadline:
        time.sleep(0.05)
