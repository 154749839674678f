"""Hardening (issue 11): SMP restarts, corruption, hostile control frames, EC lag, private shared memory and
authenticated peer payloads, against real SMP daemons, real sockets and real /dev/shm."""
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from conftest import wait_protected

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.capture.restore import NoUsableSnapshot
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.cluster import transport
from inmem_ft.errors import InmemFTError, SMPUnavailable
from inmem_ft.launcher.ports import free_port
from inmem_ft.smp import control, inventory, paths, protocol
from inmem_ft.smp.client import SMPClient
from inmem_ft.smp.segments import Segment, names_with_prefix, path_of
from inmem_ft.snapshot import segment as seg
from inmem_ft.snapshot.checksum import checksum, to_hex


def state(seed=0, n=1000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def test_smp_killed_mid_write_then_restarted_every_later_snapshot_commits(job):
    """The restarted SMP discards the unfinished slot and creates a new segment under the same name; the
    trainer must write into that one, not into the unlinked one it still maps."""
    proc = control.start(job, 0, 64 << 20)
    snap = Snapshotter(SnapshotConfig(job=job, interval=1))
    calls = snap._smp.call

    def killing_commit(op, **fields):
        if op == "commit" and fields["step"] == 2:  # the slot is written, its commit never reaches the SMP
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        return calls(op, **fields)

    snap._smp.call = killing_commit
    try:
        snap.save(1, state(1))
        snap.save(2, state(2))
        snap.wait()
        assert snap.metrics.failures == 1
        control.start(job, 0, 64 << 20)
        for step in range(3, 7):
            snap.save(step, state(step))
            snap.wait()
        assert snap.metrics.failures == 1 and snap.metrics.snapshots == 5
        snap.close()
        log = open(paths.default_log(job, 0)).read()
        assert "never committed" in log  # the torn slot of step 2, discarded by the restarted SMP
        restored = Snapshotter(SnapshotConfig(job=job)).restore()
        assert restored["step"] == 6 and torch.equal(restored["w"], state(6)["w"])
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)


# ---- the control socket survives any frame ---------------------------------------------------------------
def _frame(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


HOSTILE = [
    b"{not json", b"\xff\xfe{}", b'{"op": "\xc3\x28"}', b"[" * 100_000 + b"]" * 100_000,
    b'{"op": "begin", "rank": NaN, "step": 1, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": Infinity, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": 1e999, "manifest_len": 10, "data_len": 10}',
    b'{"op": "list", "rank": ' + b"9" * 5000 + b"}", b"[1, 2]", b'"ping"', b"null", b"{}",
    b'{"op": ["ping"]}', b'{"op": {"a": 1}}', b'{"op": "nope"}', b'{"op": "__init__"}',
    b'{"op": "begin", "rank": -1, "step": 1, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": -5, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": 18446744073709551616, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": "0", "step": 1, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": true, "step": 1, "manifest_len": 10, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": 1, "manifest_len": -4096, "data_len": 10}',
    b'{"op": "begin", "rank": 0, "step": 1, "manifest_len": 10, "data_len": 1125899906842624000}',
    b'{"op": "begin", "rank": 0, "step": 1, "manifest_len": 10, "data_len": 10, "keep_step": "x"}',
    b'{"op": "begin", "rank": 0, "step": 1, "manifest_len": 10, "data_len": 10, "local_ranks": -3}',
    b'{"op": "commit", "rank": 0, "step": 1.5}', b'{"op": "complete", "step": [3]}',
    b'{"op": "restored", "rank": 0, "step": -1}', b'{"op": "read", "node": -1, "rank": 0, "step": 1, '
    b'"offset": 0, "length": 10}', b'{"op": "read", "node": 0, "rank": 0, "step": 1, "offset": -1, "length": 9}',
    b'{"op": "read", "node": 0, "rank": 0, "step": 1, "offset": 0, "length": 1099511627776}',
    b'{"op": "catalog", "step": "all"}', b'{"op": "pull", "rank": null}',
]
OPS = ["ping", "begin", "commit", "abort", "list", "complete", "restored", "status", "catalog", "read", "pull"]


def _ask(sock, raw: bytes) -> dict:
    sock.sendall(_frame(raw))
    return protocol.recv(sock)


@hypothesis.settings(max_examples=300, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(op=st.sampled_from(OPS), extra=st.dictionaries(
    st.sampled_from(["rank", "step", "keep_step", "manifest_len", "data_len", "local_ranks", "node", "offset",
                     "length", "reserve", "wipe"]),
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(0, 4096),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
              st.lists(st.integers(), max_size=3))))
def _fuzz(sock, op, extra):
    reply = _ask(sock, json.dumps({"op": op, **extra}).encode())
    assert reply["ok"] or reply["code"] in {"bad_request", "budget", "corrupt", "lost", "error"}, reply
    assert reply["ok"] or reply["code"] != "error", reply  # "error" is a bug in the daemon


def test_control_socket_survives_any_frame(job):
    budget = 64 << 20
    control.start(job, 0, budget)
    socket_path = paths.default_socket(job, 0)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(socket_path)
            for raw in HOSTILE:
                reply = _ask(sock, raw)
                assert not reply["ok"] and reply["code"] == "bad_request", (raw[:80], reply)
            _fuzz(sock)
            # A frame longer than any message: refused, and the connection closed (it cannot be framed).
            sock.sendall(struct.pack(">I", protocol.MAX_MESSAGE + 1))
            assert protocol.recv(sock)["code"] == "bad_request"
        # Every segment a request made is one adoption parses, inside the budget, and one wipe removes.
        names = [n for n in names_with_prefix(paths.segment_prefix(job, 0)) if not n.endswith(("complete", "lock"))]
        assert all(paths.parse_segment_name(n) for n in names), names
        assert sum(os.path.getsize(path_of(n)) for n in names) <= budget
        assert control.call(socket_path, "status")["used"] <= budget
        # The SMP still serves a real trainer.
        control.call(socket_path, "restored", rank=0, step=None)
        with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
            snap.save(1, state(1))
            snap.wait()
            assert snap.metrics.snapshots == 1 and snap.restore()["step"] == 1
        log = open(paths.default_log(job, 0)).read()
        assert "Traceback" not in log and "event=request_failed" not in log
        control.stop(socket_path, wipe=True)
        assert names_with_prefix(paths.segment_prefix(job, 0)) == []
    finally:
        if control.ping(socket_path):
            control.stop(socket_path, wipe=True)


# ---- every detected corruption is said -------------------------------------------------------------------
def _flip_header(name: str) -> None:
    fd = os.open(path_of(name), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, 16)  # inside the step field: the header checksum no longer matches
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), 16)
    finally:
        os.close(fd)


def _slots(job):
    return [n for n in names_with_prefix(paths.segment_prefix(job, 0)) if paths.parse_segment_name(n)]


def _log_when(job, text, timeout=10, node=0):
    deadline = time.monotonic() + timeout  # a killed SMP's replacement logs adoption before it answers
    while text not in open(paths.default_log(job, node)).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    return open(paths.default_log(job, node)).read()


def test_a_node_of_ranks_connecting_while_the_smp_is_busy_all_get_in(job):
    """Connections wait in the listen backlog until the SMP accepts them; a backlog too short for a node's ranks
    refused the extra ones at once (EAGAIN), which 8 ranks of a loaded node hit."""
    proc = control.start(job, 0, 64 << 20)
    socket_path = paths.default_socket(job, 0)
    socks = []
    os.kill(proc.pid, signal.SIGSTOP)  # busy: accepts nothing meanwhile
    try:
        for _ in range(32):
            socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            socks[-1].settimeout(30)  # as SMPClient connects
            socks[-1].connect(socket_path)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    try:
        for sock in socks:
            protocol.send(sock, {"op": "ping"})
            assert protocol.recv(sock)["job"] == job
    finally:
        for sock in socks:
            sock.close()
        control.stop(socket_path, wipe=True)


def test_both_headers_corrupted_is_said_and_restore_refuses_to_start_over(job):
    control.start(job, 0, 64 << 20)
    try:
        with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
            snap.save(1, state(1))
            snap.save(2, state(2))
        assert len(_slots(job)) == 2
        for name in _slots(job):
            _flip_header(name)
        with pytest.raises(NoUsableSnapshot, match="completed step 2"):
            Snapshotter(SnapshotConfig(job=job)).restore()
        assert _log_when(job, "event=corrupt").count("event=corrupt") == 2
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)


def test_restarted_smp_says_corrupt_slots_and_not_blank_ones(job):
    """One committed slot, one reserved and never written: after a kill -9, the restarted SMP reports the
    corrupted header as corrupt, the blank slot as empty (not torn), and restore fails instead of starting
    over."""
    proc = control.start(job, 0, 64 << 20)
    try:
        with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
            snap.save(1, state(1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        committed = [n for n in _slots(job) if seg.Header.read(Segment(n).buf) is not None]
        assert len(committed) == 1 and len(_slots(job)) == 2
        _flip_header(committed[0])
        control.start(job, 0, 64 << 20)
        log = _log_when(job, "event=ready")
        assert "event=corrupt" in log and "event=empty" in log
        assert "event=torn" not in log and "never committed" not in log
        with pytest.raises(NoUsableSnapshot, match="completed step 1"):
            Snapshotter(SnapshotConfig(job=job)).restore()
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)


# ---- erasure-coding lag never stalls training ------------------------------------------------------------
def _write_rank(socket_path, rank, step, keep, size=None):
    """Commit `step` of `rank` by hand (a trainer of another node), random bytes (tiny unless `size`); not yet
    complete. Returns the bytes."""
    data = os.urandom(size or 4096 + 64 * step)
    manifest = {"format": seg.FORMAT, "rank": rank, "step": step, "world_size": 2,
                "leaves": [{"o": 0, "n": len(data), "h": to_hex(checksum(data)), "dt": "uint8", "sh": [len(data)]}]}
    raw = seg.encode_manifest(manifest)
    client = SMPClient(socket_path)
    try:
        reply = client.call("begin", rank=rank, step=step, manifest_len=len(raw), data_len=len(data),
                            keep_step=keep, reserve=keep is None)
        with open(path_of(reply["segment"]), "r+b") as f:
            f.seek(seg.HEADER_SIZE)
            f.write(raw)
            f.seek(reply["data_off"])
            f.write(data)
        client.call("commit", rank=rank, step=step)
    finally:
        client.close()
    return data


def test_erasure_coding_lag_skips_a_snapshot_and_says_so(job, runtime, monkeypatch):
    """Node 1 of a 2-node EC group freezes (SIGSTOP) while step 2 is protected: the trainer on node 0 holds
    step 1 (protected) and step 2 (complete) and must neither wait nor overwrite either: step 3 is skipped,
    said and counted. Once protecting step 2 has failed, the older protected step is given up, said so, and
    snapshots commit again."""
    monkeypatch.setenv("INMEM_FT_SECRET", "test-secret-" + "y" * 20)
    with SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs"), parity=1) as cluster:
        # Both nodes hold step 1 before either is told it is complete (node 0's trainer, a job of its own,
        # completes it as soon as it commits): protection then finds it everywhere.
        _write_rank(cluster.socket_path(1), 1, 1, None)
        snap = Snapshotter(SnapshotConfig(job=job, interval=1))
        snap.save(1, state(1))
        snap.wait()
        control.call(cluster.socket_path(1), "complete", step=1)
        wait_protected(cluster, 1)
        frozen = cluster.smps[1]
        frozen.send_signal(signal.SIGSTOP)
        try:
            snap.save(2, state(2))  # complete on node 0; its protection waits on node 1
            snap.wait()
            snap.save(3, state(3), overlap=True)  # the commit thread asks for the slot and is declined
            snap.wait()
            assert snap.metrics.skipped == 1 and snap.metrics.failures == 0 and snap.metrics.snapshots == 2
        finally:
            frozen.send_signal(signal.SIGCONT)
        log = open(cluster.smp_log(0)).read()
        assert "event=skipped rank=0 step=3 reason=erasure_coding_lag" in log
        # Node 1 never held step 2, so protecting it fails; then the protected step 1 is given up, said so.
        deadline = time.monotonic() + 120
        while "event=protect_failed step=2" not in open(cluster.smp_log(0)).read():
            assert time.monotonic() < deadline, "protecting step 2 did not fail after node 1 resumed"
            time.sleep(0.1)
        snap.save(4, state(4))
        snap.wait()
        snap.close()
        assert snap.metrics.snapshots == 3 and snap.metrics.skipped == 1 and snap.metrics.failures == 0
        assert "event=unprotect rank=0 step=1" in open(cluster.smp_log(0)).read()
        assert [s["step"] for s in control.call(cluster.socket_path(0), "list", rank=0)["slots"]] == [4, 2]


DIVERGING_RANK = """
import time, torch, torch.distributed as dist
import inmem_ft
dist.init_process_group("gloo")
snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1))
snap.save(1, {"w": torch.ones(1000)})
snap.wait()
# Rank 1's state cannot be copied (a meta tensor has no bytes): torch raises, not inmem_ft.
bad = torch.empty(1000, device="meta") if dist.get_rank() == 1 else torch.ones(1000)
t0 = time.monotonic()
snap.save(2, {"w": bad})
snap.wait()
print("waited", round(time.monotonic() - t0, 1), "complete", snap._complete, "failures", snap.metrics.failures,
      flush=True)
snap.close()
"""


def test_a_foreign_exception_on_one_rank_is_voted_and_never_leaves_the_others_waiting(job, runtime):
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", DIVERGING_RANK], timeout_s=300)  # a hang would wait for gloo's 600 s
        logs = [cluster.rank_log(attempt.number, r) for r in range(2)]
        assert attempt.ok, logs
        for rank, text in enumerate(logs):
            line = next(x for x in text.splitlines() if x.startswith("waited"))
            complete, failures = int(line.split()[3]), int(line.split()[5])
            assert complete == 1, text  # step 2 counts nowhere: rank 1 voted it down
            assert failures == (1 if rank == 1 else 0), text
        assert "event=failed: NotImplementedError" in logs[1] or "event=failed: RuntimeError" in logs[1], logs[1]


GROUPS_AT_EXIT = """
import atexit, os, sys, torch, torch.distributed as dist

def gloo_threads():  # the worker threads of every gloo group alive in this process
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))

# Registered before inmem_ft's own handler, so it runs after it: what is left once inmem_ft has cleaned up.
atexit.register(lambda: print("at exit", gloo_threads(), flush=True))
import inmem_ft
dist.init_process_group("gloo")
try:
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1), dp_group=dist.new_group([0, 1]))
    snap.save(1, {"w": torch.ones(1000) * dist.get_rank()})
    snap.wait()
    print("open", gloo_threads(), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the trainer failed; its Snapshotter is never closed")
    snap.close()
finally:
    dist.destroy_process_group()  # the script's own groups (the world, the data-parallel group)
"""


@pytest.mark.parametrize("ending", ["close", "raise"])
def test_our_gloo_groups_are_destroyed_on_close_and_on_an_error_exit(job, runtime, ending):
    """Issue 23: a gloo group alive when the interpreter finalizes can abort the rank (SIGABRT, "terminate called
    without an active exception": a worker thread of the group drops a collective's tensor and asks for the GIL
    of an interpreter going away). The agreement group and its mirror are destroyed, their threads joined, by
    Snapshotter.close, and where an exception skipped it, by inmem_ft's atexit handler, before the interpreter
    finalizes; the rank ends with its own exit code."""
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", GROUPS_AT_EXIT, ending], timeout_s=300)
        logs = [cluster.rank_log(attempt.number, r) for r in range(2)]
        if ending == "close":
            assert attempt.ok, logs
        else:  # the launcher stops the other rank once one has failed
            assert attempt.returncodes[attempt.first_failure] == 1 and set(attempt.returncodes.values()) <= {1, -9}
        for rank, text in enumerate(logs):
            if attempt.returncodes[rank] == -9:
                continue
            assert int(text.split("open ")[1].split()[0]) > 0, text  # the threads counted are there while open
            assert "at exit 0" in text, text
            assert ending == "close" or "RuntimeError: the trainer failed" in text, text


STUCK_DESTROY = """
import sys, time, torch, torch.distributed as dist
from inmem_ft import teardown
from inmem_ft.teardown import run_main

teardown.DESTROY_TIMEOUT_S = 2.0

def main():
    import inmem_ft
    dist.init_process_group("gloo")
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1, timeout_s=120))
    if dist.get_rank() == 0:  # a collective of the agreement's group that rank 1 never joins: its worker waits
        pending = dist.all_reduce(torch.ones(3), group=snap._agree.group, async_op=True)
        snap.close()  # ~ProcessGroupGloo joins that worker: it would wait for the group's 120 s timeout
        print("closed at", time.time(), flush=True)
    else:
        time.sleep(25)  # alive, connected, and not in the collective, until well after rank 0 is gone
        print("closing at", time.time(), flush=True)
        snap.close()

run_main(main)
"""


def test_a_destroy_of_our_group_that_cannot_end_is_bounded_and_said_in_one_line(job, runtime):
    """The snapshot agreement's gloo group is destroyed at close with a bound (teardown.DESTROY_TIMEOUT_S): where
    the destroy waits on a peer (here a collective of the group that the other rank never joins), the rank says
    so in one line and exits with its own code, long before the group's timeout."""
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", STUCK_DESTROY], timeout_s=300)
        log = cluster.rank_log(attempt.number, 0)
        assert attempt.ok, log
        closed = float(re.search(r"closed at ([\d.]+)", log).group(1))
        other = float(re.search(r"closing at ([\d.]+)", cluster.rank_log(attempt.number, 1)).group(1))
        assert closed < other - 15, log  # not when rank 1 closed, nor at the group's 120 s timeout
        [line] = [line for line in log.splitlines() if "event=teardown_stuck" in line]
        assert "did not end in 2 s" in line and "closed" in log


DESTROY_AFTER_A_COLLECTIVE = """
import torch, torch.distributed as dist
from inmem_ft import teardown

dist.init_process_group("gloo")
for _ in range(20):
    group = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(1000), group=group)  # a tensor Python lets go of before the worker does
    teardown.bounded(lambda: dist.destroy_process_group(group), "a group", dist.get_rank())
    del group  # the script's own last reference, as a DeepSpeed engine's go: ~ProcessGroupGloo runs here
print("destroyed", flush=True)
teardown.bounded(dist.destroy_process_group, "the world", dist.get_rank())
"""


@pytest.mark.compat
def test_a_group_destroyed_right_after_its_collective_ends_on_every_torch(job, runtime):
    """On torch 2.6, ~ProcessGroupGloo runs holding the GIL and waits for the worker thread that frees the last
    collective's work, which needs the GIL to free a tensor Python let go of: without teardown.SETTLE_S this test
    hung in 1 of 3 runs there (and a DeepSpeed ZeRO-3 rank of the torch-2.6 combination at its exit)."""
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", DESTROY_AFTER_A_COLLECTIVE], timeout_s=120)
        logs = [cluster.rank_log(attempt.number, r) for r in (0, 1)]
        assert attempt.ok and all("destroyed" in log and "teardown_stuck" not in log for log in logs), logs


GIL_HELD_DESTROY = """
import ctypes
from inmem_ft import teardown

teardown.DESTROY_TIMEOUT_S, teardown.WATCHDOG_GRACE_S = 1.0, 2.0
# libc's sleep called through PyDLL keeps the GIL, as ~ProcessGroupGloo does on torch 2.6
teardown.bounded(lambda: ctypes.PyDLL(None).sleep(120), "a group", 0)
print("returned", flush=True)
"""


def test_a_destroy_that_holds_the_gil_still_ends_the_process_with_the_stacks_in_the_log():
    """No Python thread runs while a destroy waits holding the GIL, the bounding one neither: faulthandler's C
    watchdog ends the process past the bound, with exit code 1 and every thread's stack."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", GIL_HELD_DESTROY], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and time.monotonic() - t0 < 30, (out.returncode, out.stderr)
    assert "returned" not in out.stdout and "Timeout (0:00:03)!" in out.stderr and "in bounded" in out.stderr


STUCK_WORLD_DESTROY = """
import os, time, torch, torch.distributed as dist
from datetime import timedelta
from inmem_ft import teardown
from inmem_ft.teardown import run_main

teardown.DESTROY_TIMEOUT_S = 2.0

def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 0:  # a collective of the world that rank 1 never joins: the world's worker waits in it
        dist.all_reduce(torch.ones(3), async_op=True)
        return  # run_main destroys the world: ~ProcessGroupGloo joins that worker, up to the group's 120 s timeout
    start = time.time()
    while os.path.exists(f"/proc/{pids[0]}") and open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        if time.time() - start > 100:
            break
        time.sleep(0.1)
    print(f"rank 0 ended after {time.time() - start:.1f} s", flush=True)

run_main(main)
"""


def test_a_destroy_of_the_world_group_that_cannot_end_is_bounded_and_said_in_one_line(job, runtime):
    """teardown.run_main destroys the world group with the same bound as the agreement's groups: where the destroy
    waits on a peer (a collective of the world that the other rank never joins), the rank says so in one line and
    exits with its own code, long before the group's timeout."""
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", STUCK_WORLD_DESTROY], timeout_s=300)
        log = cluster.rank_log(attempt.number, 0)
        assert attempt.ok, (log, cluster.rank_log(attempt.number, 1))
        ended = float(re.search(r"rank 0 ended after ([\d.]+) s", cluster.rank_log(attempt.number, 1)).group(1))
        assert ended < 30, ended  # not at the group's 120 s timeout
        [line] = [line for line in log.splitlines() if "event=teardown_stuck" in line]
        assert "destroying the world process group did not end in 2 s" in line, line


RUN_MAIN = """
import atexit, os, sys, torch, torch.distributed as dist
from inmem_ft.teardown import gloo_threads, run_main

atexit.register(lambda: print("at exit", gloo_threads(), flush=True))  # never printed where run_main os._exits

def main():
    import inmem_ft
    dist.init_process_group("gloo")
    dp = dist.new_group([0, 1])  # a group of the script's own, held by this frame when the exception leaves it
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1), dp_group=dp)
    snap.save(1, {"w": torch.ones(1000) * dist.get_rank()})
    snap.wait()
    t = torch.ones(3)
    dist.all_reduce(t, group=dp)  # the script's own last collective, just before it ends
    print("open", gloo_threads(), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the trainer failed")
    return 3 if sys.argv[1] == "code" else None

run_main(main)
"""


@pytest.mark.parametrize("ending", ["return", "code", "raise"])
def test_run_main_ends_a_trainer_with_its_own_exit_code_and_no_group_left(job, runtime, ending):
    """inmem_ft.teardown.run_main (the examples' and harnesses' entry point): whatever main did, every process
    group (inmem_ft's, the world, the script's own) is destroyed and its threads joined before the interpreter
    finalizes, and the process exits with main's code: 0, its int, or 1 after an exception's traceback."""
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", RUN_MAIN, ending], timeout_s=300)
        logs = [cluster.rank_log(attempt.number, r) for r in range(2)]
        code = {"return": 0, "code": 3, "raise": 1}[ending]
        if ending == "return":
            assert attempt.ok, logs
        else:  # the launcher stops the other rank once one has failed
            assert attempt.returncodes[attempt.first_failure] == code, logs
            assert set(attempt.returncodes.values()) <= {code, -9}, logs
        for rank, text in enumerate(logs):
            if attempt.returncodes[rank] == -9:
                continue
            assert int(text.split("open ")[1].split()[0]) > 0, text
            assert "at exit 0" in text, text
            assert ending != "raise" or "RuntimeError: the trainer failed" in text, text


# ---- shared memory is private ----------------------------------------------------------------------------
def _two_steps_then_kill_the_smp(job):
    proc = control.start(job, 0, 64 << 20)
    with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
        snap.save(1, state(1))
        snap.save(2, state(2))
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_segments_live_in_an_owner_only_namespace_and_a_planted_one_is_refused(job, tmp_path):
    """Slots another owner holds, ones with group/other permissions, and links are refused (event=refused),
    left in place and never adopted; restore then fails rather than start over."""
    _two_steps_then_kill_the_smp(job)
    directory = os.path.dirname(path_of(_slots(job)[0]))
    assert directory == f"/dev/shm/inmemft-{os.getuid()}" and stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    old, new = _slots(job)  # generation 0 of slots 0 and 1: steps 1 and 2
    os.chmod(path_of(new), 0o644)
    if os.getuid() == 0:  # only root can give a file away; elsewhere the mode and link cases carry the test
        os.chown(path_of(old), 65534, 65534)
    link = paths.segment_name(job, 0, 1, 0, 0)  # a "slot" of rank 1 that points at a file of ours elsewhere
    shutil.copy(path_of(new), tmp_path / "elsewhere")
    os.chmod(tmp_path / "elsewhere", 0o600)
    os.symlink(tmp_path / "elsewhere", path_of(link))
    control.start(job, 0, 64 << 20)
    try:
        log = _log_when(job, "event=ready")
        refused = [line for line in log.splitlines() if "event=refused" in line]
        assert len(refused) == (3 if os.getuid() == 0 else 2), refused
        assert any(new in line and "mode 0o644" in line for line in refused)
        assert any(link in line and "symbolic link" in line for line in refused)
        socket_path = paths.default_socket(job, 0)
        assert control.call(socket_path, "list", rank=1)["slots"] == []
        if os.getuid() == 0:
            assert control.call(socket_path, "list", rank=0)["slots"] == []
        assert all(os.path.lexists(path_of(n)) for n in (old, new, link))  # refused, not deleted
        with pytest.raises(NoUsableSnapshot, match="completed step 2"):
            Snapshotter(SnapshotConfig(job=job)).restore()
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)
    # A wipe frees what the SMP held; what it refused stays for the operator, whom `smp clean` serves.
    assert names_with_prefix(paths.segment_prefix(job, 0)) == sorted([old, new, link])
    assert "removed 3 segment(s)" in _cli("smp", "clean", "--job", job).stdout
    assert names_with_prefix(paths.segment_prefix(job, 0)) == []


def test_a_namespace_directory_that_is_not_private_is_refused(tmp_path, monkeypatch):
    from inmem_ft.errors import ForeignSegment
    from inmem_ft.smp import segments

    monkeypatch.setattr(segments, "SHM_DIR", str(tmp_path))
    own = tmp_path / f"inmemft-{os.getuid()}"
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    with pytest.raises(ForeignSegment, match="mode 0700, but it is a directory .* mode 0o755"):
        Segment("inmemft.x.n0.r0.s0.g0", 4096, create=True)
    own.rmdir()
    os.symlink(tmp_path, own)  # a link planted where the directory would be
    with pytest.raises(ForeignSegment, match="it is a non-directory"):
        segments.names_with_prefix("inmemft.")
    own.unlink()
    segment = Segment("inmemft.x.n0.r0.s0.g0", 4096, create=True)  # created 0700 when missing
    assert stat.S_IMODE(own.stat().st_mode) == 0o700 and stat.S_IMODE(os.stat(path_of(segment.name)).st_mode) == 0o600
    segment.close()


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "inmem_ft", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_stale_segments_are_listed_and_cleaned_with_no_smp_running(job, runtime):
    """An SMP killed with its job leaves its segments: `smp status` lists them with no SMP running, `smp clean`
    removes them (honouring --older-than), and never touches those a running SMP serves, nor lets a second
    SMP serve the same node."""
    live = f"{job}live"
    _two_steps_then_kill_the_smp(job)
    control.start(live, 0, 64 << 20)
    try:
        with Snapshotter(SnapshotConfig(job=live, interval=1)) as snap:
            snap.save(1, state(1))
        with pytest.raises(SMPUnavailable, match=f"already serves job {live} node 0"):
            control.start(live, 0, 64 << 20, socket_path=str(runtime / "other.sock"))
        out = _cli("smp", "status", "--job", job)
        assert out.returncode == 1 and "no SMP is listening" in out.stderr
        row = next(line.split() for line in out.stdout.splitlines() if line.startswith(job + " "))
        assert row[1] == "0" and row[2] == "3" and row[-1] == "2"  # 2 slots and the record of the complete step
        status = json.loads(_cli("smp", "status", "--job", live, "--json").stdout)
        assert status["job"] == live and any(s["job"] == job for s in status["stale"])
        assert not any(s["job"] == live for s in status["stale"])  # its SMP runs
        assert _cli("smp", "clean").returncode == 1  # says what to remove first
        kept = _cli("smp", "clean", "--job", job, "--older-than", "1h")
        assert kept.returncode == 0 and "no segments to remove" in kept.stdout
        assert len(names_with_prefix(paths.segment_prefix(job, 0))) == 4  # and the lock the killed SMP held
        cleaned = _cli("smp", "clean", "--job", job)
        assert cleaned.returncode == 0 and f"removed 3 segment(s) of job {job} node 0" in cleaned.stdout
        assert names_with_prefix(paths.segment_prefix(job, 0)) == []
        served = _cli("smp", "clean", "--job", live)
        assert f"kept job {live} node 0: its SMP (pid" in served.stdout
        assert control.call(paths.default_socket(live, 0), "status")["job"] == live
        with pytest.raises(SMPUnavailable, match="still serves"):
            inventory.remove(live, 0)
    finally:
        control.stop(paths.default_socket(live, 0), wipe=True)
    assert names_with_prefix(paths.segment_prefix(live, 0)) == []


# ---- peer payloads are authenticated ----------------------------------------------------------------------
SECRET = "hardening-secret-" + "p" * 20
FLIP_AT = 200_000  # a byte of the server's stream far past the handshake and the reply header: in the payload


class TamperingProxy:
    """A real TCP relay to `target`; a connection opened while it is armed has one byte of what the server sends
    flipped on the way (FLIP_AT)."""

    def __init__(self, target):
        self.target, self.armed = target, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.armed), daemon=True).start()

    @staticmethod
    def _pump(src, dst, flip):
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip and seen <= FLIP_AT < seen + len(data):
                    data = bytearray(data)
                    data[FLIP_AT - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()

    def close(self):
        self.listener.close()


def _smp_with_peers(job, node, peers):
    """An SMP linked to its peers by the list `peers` (nodes may be given different lists, as by a typo)."""
    return control.start(job, node, 64 << 20, extra_args=["--peers", peers],
                         env={**os.environ, "INMEM_FT_SECRET": SECRET})


def _stop(job, nodes):
    for node in nodes:
        if control.ping(paths.default_socket(job, node)):
            control.stop(paths.default_socket(job, node), wipe=True)


def test_a_payload_flipped_on_the_wire_is_refused_and_a_clean_one_passes(job):
    """Node 0 reads node 1's slot through a real relay that flips one payload byte: node 0 refuses it
    (event=refused, the read fails saying why) and reads the exact bytes once the relay is honest."""
    ports = [free_port(), free_port()]
    _smp_with_peers(job, 1, f"0=127.0.0.1:{ports[0]},1=127.0.0.1:{ports[1]}")
    proxy = TamperingProxy(("127.0.0.1", ports[1]))
    _smp_with_peers(job, 0, f"0=127.0.0.1:{ports[0]},1={proxy.address}")
    client = SMPClient(paths.default_socket(job, 0))
    try:
        data = _write_rank(paths.default_socket(job, 1), 1, 1, None, size=1 << 20)
        [entry] = control.call(paths.default_socket(job, 1), "list", rank=1)["slots"]
        with open(path_of(entry["segment"]), "rb") as f:
            header = seg.Header.read(f.read(seg.HEADER_SIZE))
        proxy.armed = True
        with pytest.raises(InmemFTError, match=r"payload of \d+ bytes fails its MAC: tampered with in transit"):
            client.read(1, 1, 1, header.data_off, len(data))
        log = open(paths.default_log(job, 0)).read()
        assert "transport node=0 event=refused peer=1" in log and "fails its MAC" in log
        proxy.armed = False
        got, source = client.read(1, 1, 1, header.data_off, len(data))
        assert source == "memory" and got.tobytes() == data
    finally:
        client.close()
        proxy.close()
        _stop(job, (0, 1))


def test_a_wrong_peers_entry_is_caught_naming_both_nodes(job):
    """Node 0's --peers gives node 2's address to node 1: node 0 says so instead of talking to the wrong node,
    and node 2 refuses it too."""
    ports = [free_port() for _ in range(3)]
    right = ",".join(f"{n}=127.0.0.1:{p}" for n, p in enumerate(ports))
    _smp_with_peers(job, 2, right)
    _smp_with_peers(job, 0, f"0=127.0.0.1:{ports[0]},1=127.0.0.1:{ports[2]}")
    client = SMPClient(paths.default_socket(job, 0))
    try:
        [unreachable] = client.catalog()["unreachable"]
        assert unreachable["node"] == 1
        assert f"the SMP at 127.0.0.1:{ports[2]} is node 2 of job {job}, but node 0's --peers gives that address " \
               f"to node 1" in unreachable["error"]
        log = _log_when(job, "event=refused", node=2)  # node 2 logs once its proof is out: maybe after node 0 read it
        assert "node 0 reached this SMP as node 1, but it is node 2" in log
    finally:
        client.close()
        _stop(job, (0, 2))


def test_an_unauthenticated_peer_is_dropped_within_seconds(job):
    """A connection that says nothing, and one that trickles a byte at a time, are both dropped once the
    handshake time is up (transport.HANDSHAKE_S), and said."""
    port = free_port()
    _smp_with_peers(job, 0, f"0=127.0.0.1:{port}")
    try:
        idle, trickle = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
        hello = iter(struct.pack(">I", 1000) + b" " * 1000)  # a frame that would be valid, one byte a round
        deadline = time.monotonic() + 60  # far above HANDSHAKE_S: a bound, not a timing
        open_ = {idle, trickle}
        while open_ and time.monotonic() < deadline:
            for sock in list(open_):
                try:
                    if sock is trickle:
                        sock.sendall(bytes([next(hello)]))
                    sock.settimeout(0.2)
                    while sock.recv(4096):  # the server's hello; b"" once it hangs up
                        pass
                    open_.discard(sock)
                except socket.timeout:
                    pass
                except OSError:
                    open_.discard(sock)
        assert not open_, "an unauthenticated connection was still open after 60 s"
        said = f"reason=no valid handshake within {transport.HANDSHAKE_S:.0f} s: dropped"
        while open(paths.default_log(job, 0)).read().count(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the log line may trail the hang-up
        assert open(paths.default_log(job, 0)).read().count(said) == 2
    finally:
        _stop(job, (0,))
