"""Hardening (issue 11): SMP restarts, corruption, hostile control frames and EC lag, against real SMP
daemons, real sockets and real /dev/shm."""
import json
import os
import signal
import socket
import struct
import time

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from conftest import wait_protected

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.capture.restore import NoUsableSnapshot
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control, paths, protocol
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
        names = [n for n in names_with_prefix(paths.segment_prefix(job, 0)) if not n.endswith("complete")]
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


def _log_when(job, text, timeout=10):
    deadline = time.monotonic() + timeout  # a killed SMP's replacement logs adoption before it answers
    while text not in open(paths.default_log(job, 0)).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    return open(paths.default_log(job, 0)).read()


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
def _write_rank(socket_path, rank, step, keep):
    """Commit `step` of `rank` by hand (a trainer of another node), tiny random bytes; not yet complete."""
    data = os.urandom(4096 + 64 * step)
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
            snap.save(3, state(3))
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
