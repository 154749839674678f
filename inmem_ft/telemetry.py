"""What a trainer tells the outside world: a per-rank heartbeat file, the loss log, and log lines.

Supervisors (`inmem-ft launch`, the demo) read heartbeats and losses to notice hung ranks, to inject
failures at a given step and to draw the timeline. Both are opt-in through environment variables the
supervisor sets, and cost one small file write per step. No torch at import: the SMP daemon logs through
here too.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import time

LOG_FORMAT = "%(asctime)s %(levelname)s [inmem_ft] %(message)s"
HEARTBEAT_DIR = "INMEM_FT_HEARTBEAT_DIR"
LOSS_LOG = "INMEM_FT_LOSS_LOG"


class Heartbeat:
    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank{rank}.json")
        self.state: dict = {"rank": rank, "pid": os.getpid(), "attempt": os.environ.get("INMEM_FT_ATTEMPT")}

    @classmethod
    def from_env(cls, rank: int) -> "Heartbeat | None":
        directory = os.environ.get(HEARTBEAT_DIR)
        if not directory:
            return None
        dump_stacks_on(STACK_SIGNAL)
        return cls(directory, rank)

    def beat(self, **fields) -> None:
        self.state.update(fields, time=time.time())
        write_record(self.path, self.state)


STACK_SIGNAL = signal.SIGUSR1  # a supervisor that finds this rank hung asks for its stacks with it


def dump_stacks_on(signum: int) -> None:
    """Print every thread's Python stack to stderr (the rank's log) on `signum`, from C, so that also a rank
    stuck holding the GIL answers. Only where nothing else handles the signal: it is the application's first."""
    if signal.getsignal(signum) == signal.SIG_DFL:
        faulthandler.register(signum, all_threads=True, chain=False)


def write_record(path: str, record: dict) -> None:
    """Replace the JSON file `path` with `record`; readers never see half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_record(path: str) -> dict | None:
    """What write_record last wrote to `path`; None if nothing was written (yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_heartbeats(directory: str) -> dict[int, dict]:
    out = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith("rank") and name.endswith(".json"):
            beat = read_record(os.path.join(directory, name))
            if beat is not None:
                out[beat["rank"]] = beat
    return out


def log_to_stderr(level: int = logging.INFO) -> None:
    """Print inmem_ft's log lines, and only those, to stderr with the documented `[inmem_ft]` prefix
    (`event=commit`, `source=memory`, ...), whatever the application's own logging does."""
    logger = logging.getLogger("inmem_ft")
    if not any(getattr(h, "inmem_ft", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.inmem_ft = True
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # an application's root handler would print the lines again, without it


def report_loss(step: int, loss: float, path: str | None = None, **extra) -> None:
    """Append (step, loss) to the loss log (`path` or $INMEM_FT_LOSS_LOG) from rank 0; a no-op without one.
    `extra`: more numbers of the step to log beside it (e.g. grad_norm)."""
    import torch.distributed as dist

    path = path or os.environ.get(LOSS_LOG)
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": float(loss), **extra, "time": time.time()}) + "\n")


class Tail:
    """The whole lines appended to a file since the last look (a log or the loss log, read while written)."""

    def __init__(self, path: str, from_end: bool = False):
        self.path = path
        self.offset = os.path.getsize(path) if from_end and os.path.exists(path) else 0

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        done = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        self.offset += done
        return data[:done].decode(errors="replace").splitlines()

    def records(self) -> list[dict]:
        """The new lines of a JSON-lines file (the loss log), parsed."""
        return [json.loads(line) for line in self.lines() if line.strip()]


def read_losses(path: str) -> dict[int, float]:
    """The loss of each step; a step run again after a restart keeps its last value."""
    return {rec["step"]: rec["loss"] for rec in Tail(path).records()}
