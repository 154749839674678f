"""Issue 2's acceptance: 2 simulated nodes x 2 ranks train; kill -9 ranks (and SMPs); the restarted job
resumes from the SMPs and reproduces the uninterrupted loss trajectory exactly."""
import os
import struct

import pytest

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.telemetry import read_losses
from inmem_ft.smp import control
from inmem_ft.snapshot import segment as seg
from inmem_ft.smp.segments import path_of

STEPS, INTERVAL = 20, 5
EXAMPLE = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", str(STEPS), "--interval", str(INTERVAL)]


@pytest.fixture
def cluster(job, runtime):
    c = SimulatedCluster(nodes=2, ranks_per_node=2, job=job, memory_budget=64 << 20, log_dir=str(runtime / "logs"))
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses, from a job of its own."""
    tmp = tmp_path_factory.mktemp("reference")
    os.environ["INMEM_FT_RUNTIME_DIR"] = str(tmp / "run")
    try:
        with SimulatedCluster(2, 2, f"reference{os.getpid()}", 64 << 20, str(tmp / "logs")) as c:
            attempt = c.run(EXAMPLE + ["--loss-log", str(tmp / "loss.jsonl")])
            assert attempt.ok, c.rank_log(attempt.number, 0)
    finally:
        del os.environ["INMEM_FT_RUNTIME_DIR"]
    losses = read_losses(tmp / "loss.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def resume(cluster, runtime, reference, first_expected, extra=()):
    log = runtime / "resumed.jsonl"
    attempt = cluster.run(EXAMPLE + ["--loss-log", str(log), *extra])
    assert attempt.ok, cluster.rank_log(attempt.number, 0)
    resumed = read_losses(log)
    assert min(resumed) == first_expected, "resumed from an unexpected snapshot"
    assert resumed == {s: reference[s] for s in range(first_expected, STEPS + 1)}  # bit-identical
    return attempt


def crash(cluster, runtime, die_at, die_rank, extra=()):
    log = runtime / "before.jsonl"
    attempt = cluster.run(EXAMPLE + ["--loss-log", str(log), "--die-at", str(die_at), "--die-rank", str(die_rank),
                                     *extra])
    assert not attempt.ok and attempt.returncodes[die_rank] == -9
    return read_losses(log)


@pytest.mark.parametrize("extra", [(), ("--dp-split", "--overlap")], ids=["full", "dp-split-overlap"])
def test_kill_one_rank_resumes_bit_identical(cluster, runtime, reference, extra):
    before = crash(cluster, runtime, die_at=12, die_rank=3, extra=extra)
    assert all(before[s] == reference[s] for s in before)
    resume(cluster, runtime, reference, first_expected=11, extra=extra)
    status = control.call(cluster.socket_path(1), "status")
    assert status["complete_step"] == STEPS


def test_all_trainers_and_smps_killed_resume_after_readoption(cluster, runtime, reference):
    crash(cluster, runtime, die_at=12, die_rank=0)
    for node in range(cluster.nodes):  # SMPs crash too, segments stay in /dev/shm
        cluster.kill_smp(node)
        cluster.start_smp(node)
    resume(cluster, runtime, reference, first_expected=11)
    assert "event=adopt" in open(runtime / "logs" / "smp-node0.log").read()


def test_corrupted_byte_falls_back_to_older_snapshot(cluster, runtime, reference):
    crash(cluster, runtime, die_at=12, die_rank=1)
    newest = control.call(cluster.socket_path(1), "list", rank=2)["slots"][0]
    assert newest["step"] == 10
    with open(path_of(newest["segment"]), "r+b") as f:
        header = seg.Header.read(f.read(seg.HEADER_SIZE))
        f.seek(header.data_off + header.data_len // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(struct.pack("B", byte[0] ^ 0x40))
    attempt = resume(cluster, runtime, reference, first_expected=6)
    assert "event=corrupt" in cluster.rank_log(attempt.number, 2)
