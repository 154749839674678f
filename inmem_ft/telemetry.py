"""What a trainer tells the outside world: a per-rank heartbeat, the loss log, and log lines.

Supervisors (`inmem-ft run`'s agent, `inmem-ft launch`, the demo) read heartbeats and losses to notice hung
ranks, to inject failures at a given step and to draw the timeline. Both are opt-in through environment
variables the supervisor sets; a heartbeat costs a few memory stores per step, the loss log one line from
rank 0. No torch at import: the SMP daemon logs through here too.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import mmap
import os
import signal
import struct
import sys
import time

LOG_FORMAT = "%(asctime)s %(levelname)s [inmem_ft] %(message)s"
HEARTBEAT_DIR = "INMEM_FT_HEARTBEAT_DIR"
LOSS_LOG = "INMEM_FT_LOSS_LOG"


class Heartbeat:
    """This rank's heartbeat: a small record in a file of its own that this process maps into memory once, so
    that a beat is a few stores into that mapping (no system call, no serialisation) beside the training step.

    Why a mapped file and not a message to the SMP: a message costs a socket round trip per step, and the
    heartbeat must keep working when the SMP is what died or hangs (the agent restarts a dead SMP, and an
    `inmem-ft launch` run may have none of its own); a file in the supervisor's folder has no such dependency,
    and the supervisor reads it with read_heartbeats() whatever beats it. The file is created 0600 (owner only).

    The per-step fields (step, done, snapshot_step, stall_s, bytes) live in the mapping; anything else a
    caller passes (the restore's details: once per process) goes to a JSON file beside it, off the hot path.
    A reader never sees a half-written record: a beat writes the slot not published, then publishes it by
    its number (two slots, so that a rank stopped in the middle of a beat still shows its last whole one).
    """

    def __init__(self, directory: str, rank: int):
        self.rank = rank
        self.path = os.path.join(directory, f"rank{rank}{BEAT_SUFFIX}")
        self.extra_path = os.path.join(directory, f"rank{rank}.json")
        self._map: mmap.mmap | None = None
        self._published: memoryview | None = None  # the beat count, as one native 8-byte word of the mapping
        self._seq = 0
        self._values = [os.getpid(), -1, 0.0, 0, -1, -1.0, -1]  # the _BODY fields, -1: not reported (yet)
        self._extra: dict = {}

    @classmethod
    def from_env(cls, rank: int) -> "Heartbeat | None":
        directory = os.environ.get(HEARTBEAT_DIR)
        if not directory:
            return None
        dump_stacks_on(STACK_SIGNAL)
        return cls(directory, rank)

    def beat(self, **fields) -> None:
        values, extra = self._values, False
        for name, value in fields.items():
            index = _FIELD_INDEX.get(name)
            if index is None:
                self._extra[name], extra = value, True
            else:
                values[index] = -1 if value is None else value
        values[2] = time.time()  # vDSO: no system call
        if self._map is None:
            self._map = self._create()
            self._published = memoryview(self._map)[:SEQ_SIZE].cast("Q")
        self._seq += 1
        _BODY.pack_into(self._map, _slot(self._seq), *values)
        # One aligned 8-byte store, which no signal splits: struct would write the count byte by byte, and a
        # rank stopped between two of them (SIGSTOP, a hang) would show a count it never published (255 -> 0).
        self._published[0] = self._seq
        if extra:
            write_record(self.extra_path, {"pid": values[0], **self._extra})

    def _create(self) -> mmap.mmap:
        """The record file, whole before it appears under its name (a reader never finds it short)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            mapped = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        return mapped


# The mapped record: the number of beats published (a native 8-byte word: the file never leaves its node), then
# two slots of the per-step fields, little-endian; beat n is in slot n % 2.
BEAT_SUFFIX = ".beat"
SEQ_SIZE = 8
_BODY = struct.Struct("<qqdqqdq")  # pid, step, time, done, snapshot_step, stall_s, bytes
_FIELDS = ("pid", "step", "time", "done", "snapshot_step", "stall_s", "bytes")
_FIELD_INDEX = {name: i for i, name in enumerate(_FIELDS) if name not in ("pid", "time")}
RECORD_SIZE = SEQ_SIZE + 2 * _BODY.size
READ_TRIES = 100


def _published(mapped: mmap.mmap) -> int:
    return int.from_bytes(mapped[:SEQ_SIZE], sys.byteorder)


def _slot(seq: int) -> int:
    return SEQ_SIZE + (seq % 2) * _BODY.size


def read_beat(path: str) -> dict | None:
    """The last beat recorded in the heartbeat file `path` (fields a beat never reported left out); None if
    there is none (yet)."""
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), RECORD_SIZE, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    with mapped:
        for _ in range(READ_TRIES):
            seq = _published(mapped)
            if seq == 0:
                return None  # created, not beaten yet
            body = _BODY.unpack_from(mapped, _slot(seq))
            if _published(mapped) == seq:  # no beat overwrote that slot meanwhile
                break
        else:  # it beats faster than this reads: the next look will do
            return None
    beat = dict(zip(_FIELDS, body))
    beat["done"] = bool(beat["done"])
    return {k: v for k, v in beat.items() if v != -1}


def read_heartbeats(directory: str) -> dict[int, dict]:
    """Every rank's last beat in `directory` (rank -> fields), with what it reported beside them (restored)."""
    out = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if not (name.startswith("rank") and name.endswith(BEAT_SUFFIX)):
            continue
        rank = name[len("rank"):-len(BEAT_SUFFIX)]
        beat = read_beat(os.path.join(directory, name)) if rank.isdigit() else None
        if beat is None:
            continue
        extra = read_record(os.path.join(directory, f"rank{rank}.json")) or {}
        if extra.get("pid") == beat["pid"]:  # else an earlier process of the rank wrote it
            beat = {**extra, **beat}
        out[int(rank)] = {"rank": int(rank), **beat}
    return out


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
    `extra`: more numbers of the step to log beside it (e.g. grad_norm). Each record names the process that
    wrote it: a restart's steps are told from the failed attempt's late ones by it, not by their order."""
    import torch.distributed as dist

    path = path or os.environ.get(LOSS_LOG)
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": float(loss), **extra, "time": time.time(), "pid": os.getpid()})
                + "\n")


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
