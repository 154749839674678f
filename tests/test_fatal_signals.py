"""The suite's fatal-signal check (tests/fatal_signals.py, used by conftest.py) itself: it names a child that
aborted, the marks a grandchild left in a log, and lets SIGKILL, clean exits and opted-out signals pass."""
import os
import subprocess
import sys

import pytest

import fatal_signals

pytest_plugins = ["pytester"]

ABORT = [sys.executable, "-c", "import os; os.abort()"]


def test_a_child_that_aborts_is_named(tmp_path):
    watch = fatal_signals.Watch("self-test")
    previous = fatal_signals.current()
    fatal_signals._current = watch
    try:
        subprocess.run(ABORT, capture_output=True)
        proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        proc.wait()
    finally:
        fatal_signals._current = previous
    found = fatal_signals.problems(watch, [str(tmp_path)], set())
    assert len(found) == 1 and "died of SIGABRT" in found[0] and "os.abort()" in found[0], found  # not SIGKILL
    assert fatal_signals.problems(watch, [str(tmp_path)], {"SIGABRT"}) == []
    line = fatal_signals.message("t::x", found)
    assert "\n" not in line and "allows_signal" in line


@pytest.mark.allows_signal("SIGABRT", "SIGSEGV")  # the logs it writes under tmp_path carry the marks
def test_an_abort_in_a_log_is_found_and_an_ordinary_log_is_not(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt1-rank0.log").write_text("step 1\nterminate called without an active exception\n")
    (tmp_path / "logs" / "attempt1-rank1.log").write_text("step 1\nevent=failed: RuntimeError\n")
    (tmp_path / "launcher.out").write_text("attempt 1: rank 3 exited with -11\nrank 2 exited with -9\n")
    found = fatal_signals.problems(fatal_signals.Watch(), [str(tmp_path)], set())
    assert len(found) == 2, found
    assert any("attempt1-rank0.log" in f and "terminate called" in f for f in found)
    assert any("launcher.out" in f and "exited with -11" in f for f in found)
    assert fatal_signals.problems(fatal_signals.Watch(), [str(tmp_path)], {"SIGABRT", "SIGSEGV"}) == []


def test_the_suite_fails_a_test_whose_process_aborts_unless_it_opts_out(pytester):
    here = os.path.dirname(os.path.abspath(__file__))
    pytester.makepyfile(fatal_signals=open(os.path.join(here, "fatal_signals.py")).read())  # the check as the
    pytester.makeconftest(open(os.path.join(here, "conftest.py")).read())  # suite installs it
    pytester.makeini("[pytest]\nmarkers =\n    allows_signal: opt-out\n")
    pytester.makepyfile(test_abort=f"""
import subprocess, sys, pytest
ABORT = {ABORT!r}

def test_aborts():
    subprocess.run(ABORT)

def test_aborts_grandchild(tmp_path):
    (tmp_path / "rank0.log").write_text("terminate called without an active exception")

@pytest.mark.allows_signal("SIGABRT")
def test_aborts_on_purpose(tmp_path):
    subprocess.run(ABORT)

def test_killed(tmp_path):
    subprocess.run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["test_abort.py::test_aborts: a process died of a fatal signal: pid * (*os.abort()) "
                                 "died of SIGABRT; *allows_signal*",
                                 "test_abort.py::test_aborts_grandchild: */rank0.log says 'terminate called'; *"])
