"""Shared fixtures: every test gets its own runtime dir (sockets, logs) and job id, so SMPs and
segments of different tests never meet, and nothing is left in /dev/shm afterwards."""
import os
import time
import uuid

import pytest

import fatal_signals
from inmem_ft.smp.segments import names_with_prefix, unlink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    fatal_signals.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:  # where the test put its SMPs' logs, before monkeypatch takes the variable back
        item.stash[_RUNTIME_DIR] = os.environ.get("INMEM_FT_RUNTIME_DIR")


_RUNTIME_DIR = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def no_fatal_signals(request):
    """Fail the test when a process it started died of SIGSEGV, SIGBUS or SIGABRT, or its logs say one did
    (tests/fatal_signals.py); set up first, so it looks after every other fixture has stopped its processes."""
    allowed = fatal_signals.allowed_by(request.node)
    watch = fatal_signals.begin(request.node.nodeid)
    before = os.environ.get("INMEM_FT_RUNTIME_DIR")
    yield
    roots = [str(request.node.funcargs["tmp_path"])] if "tmp_path" in request.node.funcargs else []
    runtime_dir = request.node.stash.get(_RUNTIME_DIR, None)  # one the test set (a shared one has others' logs)
    if runtime_dir and runtime_dir != before and not any(runtime_dir.startswith(r + os.sep) for r in roots):
        roots.append(runtime_dir)
    found = fatal_signals.problems(watch, roots, allowed)
    fatal_signals.begin("session")
    if found:
        pytest.fail(fatal_signals.message(request.node.nodeid, found), pytrace=False)


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("INMEM_FT_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path


@pytest.fixture
def job(runtime):
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    for seg in names_with_prefix(f"inmemft.{name}."):
        unlink(seg)


@pytest.fixture
def smp(job):
    """One SMP for the job (node 0): (socket path, process)."""
    from inmem_ft.smp import control, paths

    proc = control.start(job, 0, 64 << 20)
    yield paths.default_socket(job, 0), proc
    if control.ping(paths.default_socket(job, 0)):  # the first SMP, or a replacement a test started
        control.stop(paths.default_socket(job, 0), wipe=True)


def wait_protected(cluster, step, timeout=60):
    """Wait until every SMP of an erasure-coded SimulatedCluster reports `step` protected."""
    from inmem_ft.smp import control

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(control.call(cluster.socket_path(n), "status")["ec"]["protected_step"] == step
               for n in range(cluster.nodes)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not protected within {timeout} s")


def wait_for_log(path, text, timeout=120):
    """Wait until `text` appears in the log at `path` (an SMP's event line, written behind the trainers)."""
    deadline = time.monotonic() + timeout
    while text not in open(path).read():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path} within {timeout} s")
        time.sleep(0.1)


def flip_in_largest_region(segment: str) -> int:
    """Flip one bit in the middle of the largest checksummed region of committed slot `segment` (a byte gone bad
    in shared memory after the commit); its length in bytes."""
    from inmem_ft.smp.segments import path_of
    from inmem_ft.snapshot import segment as seg

    with open(path_of(segment), "r+b") as f:
        header, manifest = seg.read_committed(f.read(), segment)
        start, end, _, _ = max(seg.regions(manifest, header.data_off), key=lambda r: r[1] - r[0])
        f.seek((start + end) // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))
    return end - start
