"""No signal death goes unnoticed: a test fails when a process it started (a trainer, an SMP, a launcher) died of
SIGSEGV, SIGBUS or SIGABRT, or when its logs or captured output carry the marks such a death leaves ("terminate
called", "Segmentation fault", "core dumped", a launcher's "exited with -6"), unless the test opts out with
`@pytest.mark.allows_signal("SIGABRT", ...)` (no names: every one of them).

Direct children are seen through subprocess.Popen itself: every exit status it reaps (wait, poll, run) passes
through Popen._handle_exitstatus, patched here once per session. Grandchildren (ranks under a launcher, SMPs a
CLI started detached) are seen through what they leave: every file under the test's tmp_path (its runtime dir
and logs) and the output of every Popen.communicate is scanned after the test. SIGKILL and SIGTERM, which tests
send on purpose, never count."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

FATAL = {signal.SIGSEGV: "SIGSEGV", signal.SIGBUS: "SIGBUS", signal.SIGABRT: "SIGABRT"}
# A mark in a log, and the signals that leave it ("core dumped" follows any of them).
MARKS = {
    "terminate called": {"SIGABRT"},
    "Segmentation fault": {"SIGSEGV"},
    "core dumped": set(FATAL.values()),
}
# A launcher's line about a rank it started ("rank 1 exited with -6"): the grandchild's own death.
EXITED = re.compile(r"exited with -(%s)\b" % "|".join(str(int(s)) for s in FATAL))
FULL_SCAN_LIMIT = 64 << 20  # bigger files (snapshots, checkpoints) are scanned only when their name says log
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")


class Watch:
    """What the processes started during one test left: deaths by a fatal signal and marks in their output."""

    def __init__(self, name: str = "session"):
        self.name = name
        self.procs: list[subprocess.Popen] = []
        self.deaths: list[str] = []  # one description each
        self.outputs: list[tuple[str, str]] = []  # (process, captured text carrying a mark)
        self.lock = threading.Lock()


_current = Watch()
_installed = False


def current() -> Watch:
    return _current


def begin(name: str) -> Watch:
    global _current
    _current = Watch(name)
    return _current


def _describe(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, str) else " ".join(str(a) for a in proc.args)
    return f"pid {proc.pid} ({args[:160]})"


def install() -> None:
    """Patch subprocess.Popen (once) so every child's fatal-signal exit and marked output is recorded."""
    global _installed
    if _installed:
        return
    _installed = True
    popen = subprocess.Popen
    init, handle, communicate = popen.__init__, popen._handle_exitstatus, popen.communicate

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._fatal_watch = _current
        with _current.lock:
            _current.procs.append(self)

    def _handle_exitstatus(self, *args, **kwargs):
        handle(self, *args, **kwargs)
        rc = self.returncode
        if rc is not None and rc < 0 and -rc in FATAL:
            watch = getattr(self, "_fatal_watch", _current)
            with watch.lock:
                text = f"{_describe(self)} died of {FATAL[-rc]}"
                if text not in watch.deaths:
                    watch.deaths.append(text)

    def communicate_(self, *args, **kwargs):
        out = communicate(self, *args, **kwargs)
        for part in out:
            if part:
                text = part if isinstance(part, str) else part.decode(errors="replace")
                if any(mark in text for mark in MARKS) or EXITED.search(text):
                    watch = getattr(self, "_fatal_watch", _current)
                    with watch.lock:
                        watch.outputs.append((_describe(self), text))
        return out

    popen.__init__ = __init__
    popen._handle_exitstatus = _handle_exitstatus
    popen.communicate = communicate_


def marks_in(text: str, allowed: set[str]) -> list[str]:
    """The marks of a fatal signal in `text` that `allowed` does not excuse."""
    found = [mark for mark, signals in MARKS.items() if mark in text and not signals & allowed]
    found += [f"exited with -{m.group(1)}" for m in EXITED.finditer(text)
              if FATAL[signal.Signals(int(m.group(1)))] not in allowed]
    return found


def scan_file(path: str, allowed: set[str]) -> list[str]:
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return []
        if os.path.getsize(path) > FULL_SCAN_LIMIT and not path.endswith(LOG_SUFFIXES):
            return []
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # a file a process still running removed or keeps private
        return []
    if not any(m.encode() in data for m in MARKS) and b"exited with -" not in data:
        return []
    return marks_in(data.decode(errors="replace"), allowed)


def problems(watch: Watch, roots: list[str], allowed: set[str]) -> list[str]:
    """Every death by a fatal signal and every mark of one that `allowed` does not excuse, one short line each."""
    for proc in list(watch.procs):  # reap what exited unwaited (a detached SMP stopped over its socket)
        if proc.returncode is None:
            try:
                proc.poll()
            except Exception:
                pass
    found = [d for d in watch.deaths if d.rsplit(" ", 1)[-1] not in allowed]
    for who, text in watch.outputs:
        for mark in marks_in(text, allowed):
            found.append(f"the output of {who} says {mark!r}")
    seen = set()
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in sorted(files):
                path = os.path.realpath(os.path.join(directory, name))
                if path in seen:
                    continue
                seen.add(path)
                for mark in scan_file(path, allowed):
                    found.append(f"{path} says {mark!r}")
    return found


def message(test: str, found: list[str]) -> str:
    more = f" (and {len(found) - 1} more: {'; '.join(found[1:3])})" if len(found) > 1 else ""
    return (f"{test}: a process died of a fatal signal: {found[0]}{more}; "
            f"if the test causes it on purpose, mark it @pytest.mark.allows_signal(...)")


def allowed_by(item) -> set[str]:
    allowed: set[str] = set()
    for mark in item.iter_markers("allows_signal"):
        allowed |= set(mark.args) if mark.args else set(FATAL.values())
    unknown = allowed - set(FATAL.values())
    if unknown:
        raise ValueError(f"allows_signal names {sorted(unknown)}; it knows {sorted(FATAL.values())}")
    return allowed
