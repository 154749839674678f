"""A zygote: one process per node that imports what the node's ranks import, once, and forks a warm standby
(worker.py's standby loop) per request. N standbys then cost one import instead of N imports competing for the
cores, and a standby used up by a restart is replaced at once: a fork costs milliseconds.

    python -m inmem_ft.agent.zygote FD [RECORD]

FD is a SOCK_SEQPACKET socket to the pool (standbys.py). The zygote imports torch and torch.distributed at once
(every rank does, and it can before any rank has run: before the first rendezvous), then follows RECORD (a rank's
worker record, or the one the latest request names) as a standby does. A request is a JSON object
{"previous_record", "record"} with two file descriptors: the standby's stdin (its assignment comes there) and
where its output goes until it takes a rank; the answer is {"pid": N} or {"refused": why}. A request without
"record" and descriptors only names the record to follow.

The fork is double, so the standby's parent is the pool's process (a child subreaper): torch's agent then waits on
it, gets its exit status and signals its process group as it does for a process it started. A zygote forks only
while it has one thread and has not touched CUDA (a fork copies neither threads nor a device context); otherwise
it refuses and the pool spawns its standbys instead.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import time

from . import worker

FIRST = ["torch", "torch.distributed"]  # what every rank imports (worker.time_rendezvous needs torch.distributed)
FDS = 2  # with each request: the standby's stdin, its output
# Threads a fork may leave behind: jemalloc's background purger (pyarrow loads jemalloc) is stopped and restarted
# around a fork by jemalloc's own pthread_atfork handlers, and holds no lock of anyone else.
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def unforkable() -> str | None:
    """Why this process must not fork a standby now; None if it may."""
    others = [name for name in map(_thread_name, _other_threads()) if name not in FORK_SAFE_THREADS]
    if others:
        return (f"the zygote runs {len(others)} more threads ({', '.join(sorted(set(others)))}) after importing the "
                "ranks' modules (a fork copies only one): standbys are spawned instead")
    if "torch" in sys.modules:
        from .. import device  # here: the zygote imports torch when it chooses to

        if device.initialized():
            return "the zygote's imports started the accelerator (a fork cannot carry a device context): standbys are spawned"
    return None


def _other_threads() -> list[str]:
    return [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # gone meanwhile
        return next(iter(FORK_SAFE_THREADS))


def fork_twice() -> int | None:
    """Fork a process that forks the standby and exits: returns the standby's pid here, None in the standby (now
    an orphan, adopted by the nearest subreaper: the pool's process)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(w)
            return None
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)
    with os.fdopen(r) as f:
        told = f.read()
    return int(told) if told.isdigit() else -1


def become_standby(sock: socket.socket, fds: list[int], record: str) -> None:
    """In the fork: a session of its own (torch signals a rank's process group), stdin and output from the
    request, its own record, and random generators reseeded as a cold start's would be seeded."""
    sock.close()
    os.setsid()
    stdin, out = fds
    for target, fd in ((0, stdin), (1, out), (2, out)):
        os.dup2(fd, target)
    os.close(stdin)
    os.close(out)
    os.environ[worker.RECORD] = record
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # Python's random reseeds itself in a fork; numpy's global generator does not
        numpy.random.seed()


def serve(sock: socket.socket, preloaded: worker.Preload) -> worker.Preload | None:
    """Follow the record and answer requests until the pool closes its end; in a fork, return (as the standby)."""
    while True:
        preloaded.step()
        if not select.select([sock], [], [], worker.FOLLOW_S)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 65536, FDS)
        if not message:
            return None
        request = json.loads(message)
        preloaded.previous_record = request["previous_record"]
        if "record" not in request:  # only what to follow
            continue
        preloaded.step()  # what the rank imported since: the fork has it, rather than each fork importing it
        why = unforkable() if len(fds) == FDS else f"the request came with {len(fds)} descriptors, not {FDS}"
        if why:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"refused": why}).encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = fork_twice()
        if pid is None:
            become_standby(sock, fds, request["record"])
            preloaded.t0 = time.time()
            return preloaded
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def main() -> None:
    args = sys.argv[1:]
    if not 1 <= len(args) <= 2 or not args[0].isdigit():
        sys.exit("usage: python -m inmem_ft.agent.zygote FD [RECORD]")
    sock = socket.socket(fileno=int(args[0]))
    zygote = os.getpid()
    preloaded = serve(sock, worker.Preload(args[1] if len(args) == 2 else "", FIRST))
    if preloaded is not None:
        worker.standby(preloaded, origin=f" forked_from={zygote}")


if __name__ == "__main__":
    main()
