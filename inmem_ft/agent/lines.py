"""The two kinds of line `inmem-ft run` writes to the job's log: `launch` for the node's life (its SMP started,
reused or stopped, a signal, the run's exit, a refusal; launch_scripts/torchrun_inmem.sh writes its first ones
in the same form) and `agent` for what happens to its ranks (failures, hangs, standbys, the time lost). Each is
an event (inmem_ft/events.py): a record in the node's events file, its line written from it."""
from __future__ import annotations

import sys
from functools import partial

from .. import events


def say(kind: str, node: int | str, event: str, text: str = "", sep: str = ": ", **fields) -> dict:
    return events.emit(events.Source("agent", node), kind, event, say=_stdout, text=text, sep=sep, **fields)


def refuse(node: int | str, rc: int, message: str) -> int:
    """The one line that says what is wrong (stderr), and its `launch ... event=error` record; returns `rc`."""
    print(f"inmem-ft run: error: {message}", file=sys.stderr)
    events.emit(events.Source("agent", node), "launch", "error", say=_stderr, rc=rc, msg=message)
    return rc


def sayer(kind: str, node: int | str):
    return partial(say, kind, node)


def _stdout(line: str) -> None:
    print(f"[inmem_ft] {line}", flush=True)


def _stderr(line: str) -> None:
    print(f"[inmem_ft] {line}", file=sys.stderr, flush=True)
