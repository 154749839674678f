"""The events file (inmem_ft/events.py): owner-only, whole lines from concurrent writers, a torn line skipped with a
line saying so, and the human log line written from the record."""
import json
import os
import stat
import subprocess
import sys

from conftest import ROOT
from inmem_ft import events

APPENDERS = """
import os, sys
from inmem_ft import events
os.environ[events.EVENTS] = sys.argv[1]
for i in range(int(sys.argv[3])):
    # every other record longer than PIPE_BUF: those are written under the lock
    events.emit(events.Source("rank", 0, int(sys.argv[2])), "restore", "sentinel_trip", i=i, pad="x" * (5000 * (i % 2)))
"""
EACH = 300


def test_concurrent_appenders_torn_line_permissions_and_the_line(tmp_path, caplog):
    path = tmp_path / "node0" / "events.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDERS, str(path), str(rank), str(EACH)],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for rank in (0, 1)]
    assert [p.wait(120) for p in procs] == [0, 0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    reader = events.Reader(str(path))
    records = reader.records()
    for rank in (0, 1):  # every record whole, each writer's in its order
        assert [r["fields"]["i"] for r in events.where(records, "sentinel_trip", rank=rank)] == list(range(EACH))

    # A writer killed in the middle of its line, then another one's whole line after it.
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "wall": 1.0, "sou')
    assert reader.records() == []  # may still be being written: it waits
    os.environ[events.EVENTS] = str(path)
    try:
        said = []
        record = events.emit(events.Source("agent", 3), "agent", "failure_detected", say=said.append,
                             failure="rank 1 exited with -9", timeout_s=3.0, text="counted from the last poll")
    finally:
        del os.environ[events.EVENTS]
    assert said == ['agent node=3 event=failure_detected failure="rank 1 exited with -9" timeout_s=3: '
                    'counted from the last poll'] and events.line(record) == said[0]
    with caplog.at_level("WARNING", logger="inmem_ft.events"):
        assert reader.records() == [record]  # the torn start skipped, and said so; the record after it kept
        assert "the torn start of a line" in caplog.text
        with open(path, "ab") as f:
            f.write(json.dumps(record).encode()[:40])
        whole = events.read(str(path))
        assert "torn last line" in caplog.text
    assert len(whole) == 2 * EACH + 1
