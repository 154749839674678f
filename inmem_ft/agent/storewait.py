"""A rank other than 0 waits for rank 0's TCPStore to listen before torch connects to it.

Under `inmem-ft run` every restart's rank 0 creates the job's TCPStore in its init_process_group (the agents'
store is not shared with the ranks: run.py), and the other ranks start at the same moment. A c10d client whose
connect is refused backs off for 0.3-1 s (its exponential backoff with jitter, which torch offers no setting
for), so a rank that came a few milliseconds before rank 0's store costs the restart that much. A plain TCP
connect every 10 ms until the port accepts (then closed: the store drops a client that says nothing) brings the
real connect to the moment the store listens. Past WAIT_S, or where the rendezvous is not torch's env://
through MASTER_ADDR and MASTER_PORT, torch connects as it would have, its own timeout and message included.
"""
from __future__ import annotations

import inspect
import os
import socket
import time

PROBE_S = 0.01
WAIT_S = 60.0


def applies(init_process_group, args: tuple, kwargs: dict) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) when this call of `init_process_group` connects to rank 0's store through the
    environment (env://, no store given) from a rank other than 0; else None."""
    try:
        call = inspect.signature(init_process_group).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    rank = call.get("rank", -1)
    rank = int(os.environ.get("RANK", "0")) if rank in (-1, None) else rank
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if (call.get("store") is not None or call.get("init_method") not in (None, "env://") or rank == 0 or not addr
            or not port.isdigit() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    return addr, int(port)


def until_listening(addr: str, port: int, wait_s: float = WAIT_S) -> bool:
    """Whether `addr:port` accepted a connection within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(PROBE_S, deadline - time.monotonic())).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(PROBE_S)
