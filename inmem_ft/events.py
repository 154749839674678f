"""Timeline events: each one a JSON line in the node's events file, and its human log line written from the same
record, so that the timeline, the time-lost report and the benchmarks read records, not log text.

    {"v": 1, "wall": 1764633600.123, "mono": 81234.5,
     "source": {"role": "agent", "node": 0, "rank": null, "pid": 4242},
     "kind": "agent", "event": "failure_detected", "fields": {"failure": "rank 1 exited with -9 (SIGKILL)"},
     "text": ": counted from the last poll"}

    wall    time.time() when it happened: one clock for every process of the machine (and, as far as NTP keeps
            them together, of the cluster); the time-lost boundaries are all in it
    mono    time.monotonic(): comparable between the processes of one machine only (span lengths, immune to a
            clock step)
    source  who wrote it: role `agent` (`inmem-ft run`), `smp` (the node's SMP, its erasure coding included) or
            `rank` (a training process); node, rank (null where there is none), pid
    kind    the log line's first word (agent, launch, ec, smp, restore, ...)
    event   the event's name; fields its values (JSON numbers, strings, lists); text the line's free-text tail,
            as the line shows it after the fields (": why ...", or "" for none)

The human line is `KIND node=N|rank=R event=NAME k=v ...TEXT` (with the `[inmem_ft]` prefix where the sink adds
one); an event named as its kind leaves `event=` out (a rank's `restore rank=R step=S source=X seconds=T ...`).
A string value is written as it is, except the free-text fields named in QUOTED, in double quotes; a float to the
millisecond (the record keeps every digit).

The file is $INMEM_FT_EVENTS, which `inmem-ft run` sets for its SMP and its ranks (one file per node); without
it an event is only its log line. Created 0600 (its folder 0700); each record is one write() with O_APPEND, under
an exclusive lock when it is longer than PIPE_BUF, so lines of concurrent writers never interleave. A reader
skips, with one log line saying so, a line that is not a whole record (a writer killed in the middle of its
write), keeping the whole record another writer appended after it on the same line. Nothing here is unpickled:
JSON only.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import time
from typing import Callable, NamedTuple

from . import telemetry

EVENTS = "INMEM_FT_EVENTS"
FILE = "events.jsonl"  # its name in the agent's work dir, unless $INMEM_FT_EVENTS says elsewhere
VERSION = 1
QUOTED = ("failure", "msg")  # free text that a reader of the line splits on its quotes
RECORD_START = '{"v":'  # how every line begins: a reader finds a whole record after a torn one by it

log = logging.getLogger(__name__)
_warned: set[str] = set()


class Source(NamedTuple):
    role: str  # agent, smp or rank
    node: int | str | None
    rank: int | None = None


def emit(by: Source, kind: str, event: str, /, *, say: Callable[[str], None] | None = None, text: str = "",
         sep: str = ": ", **fields) -> dict:
    """Record `event` in $INMEM_FT_EVENTS and hand its human line to `say` (a logger's method, print); returns
    the record. `text` follows the fields after `sep`. A file that cannot be written costs the record, never the
    caller (one warning per file)."""
    record = {"v": VERSION, "wall": time.time(), "mono": time.monotonic(),
              "source": {**by._asdict(), "pid": os.getpid()},
              "kind": kind, "event": event, "fields": fields, "text": sep + text if text else ""}
    path = os.environ.get(EVENTS)
    if path:
        append(path, record)
    if say is not None:
        say(line(record))
    return record


def line(record: dict) -> str:
    """The human log line of `record` (the one formatter of every event's text)."""
    source = record["source"]
    who = f"rank={source['rank']}" if source.get("rank") is not None else f"node={source.get('node')}"
    name = "" if record["event"] == record["kind"] else f" event={record['event']}"
    return f"{record['kind']} {who}{name}" + _fields(record, " ") + record.get("text", "")


def details(record: dict) -> str:
    """What the line says after the event's name: its fields, then its text."""
    return _fields(record, "") + record.get("text", "")


def _fields(record: dict, before: str) -> str:
    said = " ".join(f"{k}={_value(k, v)}" for k, v in record["fields"].items())
    return before + said if said else ""


def _value(name: str, value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if name in QUOTED:
        return f'"{value}"'
    return str(value)


def append(path: str, record: dict) -> None:
    """One record as one line of `path`, created owner-only."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()  # starts with RECORD_START
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        _warn_once(path, f"events: cannot open {path} ({e}): events go to the log only")
        return
    try:
        if len(data) > select.PIPE_BUF:  # one write is atomic among O_APPEND writers up to PIPE_BUF: lock past it
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, data)
    except OSError as e:
        _warn_once(path, f"events: cannot write {path} ({e}): events go to the log only")
    finally:
        os.close(fd)


def _warn_once(path: str, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning(message)


class Reader:
    """The records appended to an events file since the last look (read while it is written). A line still being
    written waits for the next look; a line that is not a record is skipped with a log line naming it."""

    def __init__(self, path: str, from_end: bool = False):
        self.path = path
        self._tail = telemetry.Tail(path, from_end)

    @property
    def offset(self) -> int:
        """Where the next look starts: just past the last whole line read."""
        return self._tail.offset

    def records(self) -> list[dict]:
        return [r for r in map(self._parse, self._tail.lines()) if r is not None]

    def _parse(self, text: str) -> dict | None:
        if not text.strip():
            return None
        record = _load(text)
        if record is not None:
            return record
        # A writer killed in the middle of its line leaves it without a newline; the next record follows on it.
        start = text.rfind(RECORD_START, 1)
        record = _load(text[start:]) if start > 0 else None
        log.warning("events: skipped %s of %s that is not a whole record (a writer stopped in the middle of it?): "
                    "%.80r", "the torn start of a line" if record else "a line", self.path, text)
        return record


def read(path: str) -> list[dict]:
    """Every record of an events file that is no longer written: a last line left without its newline (its writer
    was killed mid-write) is skipped with a log line saying so."""
    reader = Reader(path)
    records = reader.records()
    try:
        with open(path, "rb") as f:
            f.seek(reader.offset)
            torn = f.read()
    except OSError:
        torn = b""
    if torn.strip():
        log.warning("events: skipped the torn last line of %s (%d bytes without a newline: its writer stopped in "
                    "the middle of it)", path, len(torn))
    return records


def _load(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if _valid(record) else None


def _valid(record) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("event"), str) and isinstance(record.get("kind"), str)
            and isinstance(record.get("source"), dict) and isinstance(record.get("fields"), dict)
            and isinstance(record.get("wall"), (int, float)))


def where(records: list[dict], event: str, **source) -> list[dict]:
    """The records of `event` whose source matches `source` (e.g. rank=3, role="smp")."""
    return [r for r in records if r["event"] == event
            and all(r["source"].get(k) == v for k, v in source.items())]
