"""The two kinds of line `inmem-ft run` writes to the job's log: `launch` for the node's life (its SMP started,
reused or stopped, a signal, the run's exit, a refusal; launch_scripts/torchrun_inmem.sh writes its first ones
in the same form) and `agent` for what happens to its ranks (failures, hangs, standbys, the time lost)."""
from __future__ import annotations

import sys
from functools import partial


def say(kind: str, node: int | str, text: str) -> None:
    print(f"[inmem_ft] {kind} node={node} {text}", flush=True)


def refuse(node: int | str, rc: int, message: str) -> int:
    """The one line that says what is wrong (stderr), and its `launch ... event=error` record; returns `rc`."""
    print(f"inmem-ft run: error: {message}", file=sys.stderr)
    print(f"[inmem_ft] launch node={node} event=error rc={rc} msg={message!r}", file=sys.stderr, flush=True)
    return rc


def sayer(kind: str, node: int | str):
    return partial(say, kind, node)
