"""Ports (issue 23): free_port's blocks never overlap while held, in one process or across processes; a
simulated SMP that cannot bind its peer port fails in one line and its cluster leaves nothing running; an SMP
restarted on its port binds again at once."""
import fcntl
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from inmem_ft.errors import SMPUnavailable
from inmem_ft.launcher import ports
from inmem_ft.launcher.ports import free_port
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control

BLOCKS = 300  # per process: random picks among ~20,000 ports would collide a few times at this count

HOLDER = """
import random, sys
from inmem_ft.launcher.ports import free_port
random.seed(int(sys.argv[1]))
out = []
for _ in range(int(sys.argv[2])):
    count = random.randint(1, 8)
    first = free_port(count)
    out += range(first, first + count)
print(" ".join(map(str, out)), flush=True)
sys.stdin.read()  # hold them until told to go
"""


def _allocate(n: int, seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    for _ in range(n):
        count = rng.randint(1, 8)
        first = free_port(count)
        out += range(first, first + count)
    return out


def _holder(seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(seed), str(BLOCKS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})


def test_blocks_never_overlap_in_one_process_or_across_processes():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    holders = [_holder(seed) for seed in (1, 2)]  # allocating while this process does
    try:
        mine = _allocate(BLOCKS, 3)
        theirs = [list(map(int, h.stdout.readline().split())) for h in holders]
        everyone = mine + theirs[0] + theirs[1]
        assert len(mine) == len(set(mine)), "one process handed out a port twice"
        assert all(len(t) > BLOCKS for t in theirs), "a holder allocated nothing"
        assert len(everyone) == len(set(everyone)), "two processes were handed the same port"
        assert all(ports.LOWEST <= p < ephemeral for p in everyone)
        # A holder that dies (kill -9 included) releases its ports: another process may reserve them again.
        holders[0].kill()
        holders[0].wait()
        first = theirs[0][0]
        fd = ports._lock_file()
        assert ports._lock(fd, first, 1), "a dead process's reservation was not released"
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, first)
        assert not ports._lock(fd, theirs[1][0], 1), "a live process's reservation was not held"
    finally:
        for h in holders:
            h.kill()
            h.wait()


def _smps_of(job: str) -> list[int]:
    """Pids of every process whose command line names the job (its SMPs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"inmem_ft.smp" in argv and job.encode() in argv:
            found.append(int(pid))
    return found


def test_a_peer_port_in_use_fails_the_cluster_in_one_line_and_leaves_no_smp(job, runtime, monkeypatch):
    """The collision issue 23 saw: --peers gives nodes 1 and 3 the same port. Node 3 cannot bind it and says
    so in one line; the cluster stops the SMPs of nodes 0-2 it had started."""
    monkeypatch.setenv("INMEM_FT_SECRET", "ports-test-secret-0123456789")
    cluster = SimulatedCluster(4, 1, job, 64 << 20, str(runtime / "logs"))
    peers = cluster.peers.split(",")
    port = int(peers[1].rsplit(":", 1)[1])
    cluster.peers = ",".join([*peers[:3], f"3=127.0.0.1:{port}"])
    with pytest.raises(SMPUnavailable) as e:
        cluster.start()
    said = str(e.value)
    assert "\n" not in said and f"peer port 127.0.0.1:{port} of node 3 is in use by another process" in said, said
    log = open(cluster.smp_log(3)).read()
    assert "Traceback" not in log and f"event=failed reason=peer port 127.0.0.1:{port}" in log.strip().splitlines()[-1]
    assert not cluster.smps and not _smps_of(job), "the SMPs started before the failure were left running"


def _time_wait_on(port: int) -> bool:
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(row[1].split(":")[1], 16) == port and row[3] == "06" for row in rows)


def test_an_smp_restarted_on_its_port_binds_again_at_once(job, runtime, monkeypatch):
    monkeypatch.setenv("INMEM_FT_SECRET", "ports-test-secret-0123456789")
    with SimulatedCluster(1, 1, job, 64 << 20, str(runtime / "logs")) as cluster:
        port = int(cluster.peers.rsplit(":", 1)[1])
        # A peer connected when the SMP dies: the dead SMP's end of it lingers in TIME_WAIT on the port.
        peer = socket.create_connection(("127.0.0.1", port))
        assert peer.recv(1)  # the server's hello: the SMP has accepted the connection
        cluster.kill_smp(0)
        peer.settimeout(10)
        while peer.recv(4096):
            pass
        peer.close()
        assert _time_wait_on(port)
        with socket.socket() as plain, pytest.raises(OSError):  # what a listener without SO_REUSEADDR meets
            plain.bind(("127.0.0.1", port))
        t0 = time.monotonic()
        cluster.start_smp(0)
        assert control.call(cluster.socket_path(0), "status")["pid"] == cluster.smps[0].pid
        assert time.monotonic() - t0 < 10
