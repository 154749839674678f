"""A rank's process under `inmem-ft launch`: runs the training command as `python ARGS...` would, and records
when the command began, and when its rendezvous (torch.distributed.init_process_group) began and ended, so
the supervisor can split the time a failure costs into process start and imports, rendezvous, and the rest.

    python -m inmem_ft.agent.worker -- ARGS...              run now (a cold start)
    python -m inmem_ft.agent.worker --standby RECORD        a warm standby, see below

A warm standby imports every module the rank's previous process has imported (listed in that process's
RECORD, which that process keeps current and the standby follows), and waits for its assignment: one JSON
line on stdin with the command (`argv`), the complete environment (`env`) and the files for its output
(`stdout`, `stderr`; null: keep the standby's own, which it inherited from its launcher). It then becomes what
a cold start of that command would be: its environment replaced by the assignment's, stdin /dev/null, stdout
and stderr those files (appended to: the launcher created them, as it does for a cold start), and the command
run as __main__. What it skips is the imports, which
cost seconds per rank. Nothing is initialised ahead (no process group, no device, no draw from a random
generator), so a restart from a standby is as correct as a cold one. Should the preload have drawn from
torch's generator, the standby says so in its record and, once assigned, execs a cold start of the rank.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import runpy
import select
import sys
import threading
import time

from ..telemetry import read_record, write_record
from . import storewait

RECORD = "INMEM_FT_WORKER_RECORD"  # where the worker writes its record; set by the launcher per rank and attempt
# torch's elastic agent (`inmem-ft run`) gives every local rank one environment: the record is then
# RECORD_DIR/rank<RANK>.json
RECORD_DIR = "INMEM_FT_WORKER_RECORD_DIR"
MODULES_EVERY_S = 0.5  # how often a rank's record gets its newly imported modules
FOLLOW_S = 1.0  # how often a waiting standby looks for modules its rank imported since


def record_path() -> str | None:
    """Where this process's record goes: $INMEM_FT_WORKER_RECORD, else one file per rank under
    $INMEM_FT_WORKER_RECORD_DIR, else nowhere."""
    if os.environ.get(RECORD):
        return os.environ[RECORD]
    directory = os.environ.get(RECORD_DIR)
    return os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.json") if directory else None


def runnable(argv: list[str]) -> bool:
    """Whether the worker can run `python argv...` itself: `-m MODULE ...` or `SCRIPT ...`. Anything else
    (interpreter options, -c) runs as given, unrecorded."""
    return (len(argv) >= 2 and argv[0] == "-m") or (bool(argv) and not argv[0].startswith("-"))


class Record:
    """This process's timestamps (time.time(), comparable with the supervisor's), written after each change."""

    def __init__(self, path: str | None, standby: bool):
        self.path = path
        self.fields: dict = {"pid": os.getpid(), "standby": standby}
        self._lock = threading.Lock()  # the module watcher notes too

    def note(self, **fields) -> None:
        with self._lock:
            self.fields.update(fields)
            if self.path:
                write_record(self.path, self.fields)


def watch_modules(record: Record, target: str) -> None:
    """Keep the record's list of imported modules current (what a standby for this rank preloads): a model's
    setup imports much after the rendezvous (a torch optimizer pulls in torch._dynamo and sympy, seconds of
    imports), and a standby started later should skip those too."""
    def modules() -> list[str]:
        return [m for m in list(sys.modules) if m not in ("__main__", "__mp_main__", target)]

    def watch(seen: int) -> None:
        while True:
            time.sleep(MODULES_EVERY_S)
            if len(sys.modules) != seen:
                seen = len(sys.modules)
                record.note(modules=modules())

    record.note(modules=modules())
    threading.Thread(target=watch, args=(len(sys.modules),), name="inmem_ft-worker-modules", daemon=True).start()


def time_rendezvous(record: Record, target: str) -> None:
    """Stamp the start and end of the first init_process_group; from then on, keep the list of modules. A rank
    other than 0 connects once rank 0's store listens (storewait.py)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def timed(*args, **kwargs):
        first = "rendezvous_start" not in record.fields
        if first:
            record.note(rendezvous_start=time.time())
            watch_modules(record, target)
        try:
            where = storewait.applies(original, args, kwargs)
            if where:
                storewait.until_listening(*where)
            return original(*args, **kwargs)
        finally:
            if first:
                record.note(rendezvous_end=time.time())

    # torch.distributed re-exports it; DeepSpeed and Megatron call it through either name.
    dist.init_process_group = distributed_c10d.init_process_group = timed


def run(argv: list[str], record: Record) -> None:
    """Run `python argv...` in this process, as __main__."""
    target = argv[1] if argv[0] == "-m" else argv[0]
    try:
        time_rendezvous(record, target)
    except ImportError:  # no torch here: nothing to time; the command runs all the same
        pass
    record.note(running=time.time(), argv=argv)
    sys.argv = script_argv(argv)
    if argv[0] == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # argv[0] becomes its path, as with -m
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target))  # `python SCRIPT` puts the script's folder first
        runpy.run_path(target, run_name="__main__")


def script_argv(argv: list[str]) -> list[str]:
    """sys.argv of `python argv...` as the command's own code sees it."""
    return [argv[1], *argv[2:]] if argv[0] == "-m" else list(argv)


def preload(names: list[str]) -> list[str]:
    """Import `names` in the order the previous process imported them; returns those that did not import
    (a module only its parent can create, say): the command imports them itself, as a cold start does."""
    failed = []
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name)
    return failed


def fresh_torch_random_state() -> bool:
    """Whether nothing has drawn from torch's default generator since `import torch` seeded it (true when torch
    is not loaded)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    seeded = torch.Generator()
    seeded.manual_seed(torch.initial_seed())
    return torch.equal(torch.random.get_rng_state(), seeded.get_state())


class Preload:
    """What a rank's previous process imported (its record, followed while it runs), imported here in its order.
    A zygote holds one and forks standbys that go on with it (zygote.py)."""

    def __init__(self, previous_record: str, first: list[str] = ()):
        self.previous_record, self.t0 = previous_record, time.time()
        self.tried: set[str] = set()
        preload(list(first))  # what a rank imports in any case: one that fails fails the rank too
        self.failed: list[str] = []
        self._argv_known = False

    def step(self) -> None:
        """Import what the previous process imported since the last step."""
        previous = read_record(self.previous_record) or {}
        if not self._argv_known and previous.get("argv"):
            sys.argv = script_argv(previous["argv"])  # what a module reading it at import sees in a cold start
            self._argv_known = True
        names = [n for n in previous.get("modules", []) if n not in sys.modules and n not in self.tried]
        self.tried.update(names)
        self.failed += preload(names)


def standby(preloaded: Preload, origin: str = "") -> None:
    """Import what the previous process imported, following its record while it runs, until an assignment
    comes; then run it (or, should the imports have drawn from torch's generator, exec a cold start of it).
    `origin`: where the process came from, for its line (a zygote's fork)."""
    record = Record(os.environ.get(RECORD), standby=True)
    ready = refused = None
    while True:
        preloaded.step()
        if refused is None and not fresh_torch_random_state():
            refused = ("importing the rank's modules drew from torch's random generator, so a rank run in this "
                       "process would not start as a cold one does")
            record.note(refused=refused)
        if ready is None:
            ready = time.time()
            record.note(ready=ready, preload_s=ready - preloaded.t0)
            failed = preloaded.failed
            print(f"[inmem_ft] standby pid={os.getpid()} preloaded={len(preloaded.tried) - len(failed)} "
                  f"failed={len(failed)} seconds={ready - preloaded.t0:.2f}{origin}"
                  f"{' not_imported=' + ','.join(failed) if failed else ''}", flush=True)
        if select.select([sys.stdin], [], [], FOLLOW_S)[0]:
            break
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the launcher is done with us
    assignment = json.loads(line)
    assigned = time.time()
    take_over_io(assignment["stdout"], assignment["stderr"])
    if refused:
        print(f"[inmem_ft] standby: {refused}; starting this rank cold", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, "--", *assignment["argv"]],
                  assignment["env"])
    os.environ.clear()
    os.environ.update(assignment["env"])
    record = Record(record_path(), standby=True)
    record.note(assigned=assigned, ready=ready)
    run(assignment["argv"], record)


def take_over_io(stdout: str | None, stderr: str | None) -> None:
    """stdin /dev/null, and stdout, stderr the rank's files where the launcher gives it some, as for a cold start."""
    sys.stdout.flush()
    sys.stderr.flush()
    opened = {}
    for fd, path in ((0, os.devnull), (1, stdout), (2, stderr)):
        if path:
            if path not in opened:
                flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_APPEND
                opened[path] = os.open(path, flags, 0o644)
            os.dup2(opened[path], fd)
    for target in opened.values():
        os.close(target)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--standby"] and len(args) == 2:
        standby(Preload(args[1]))
    elif args[:1] == ["--"] and runnable(args[1:]):
        run(args[1:], Record(record_path(), standby=False))
    else:
        sys.exit("usage: python -m inmem_ft.agent.worker (-- -m MODULE ARGS... | -- SCRIPT ARGS... | "
                 "--standby RECORD)")


if __name__ == "__main__":
    main()
