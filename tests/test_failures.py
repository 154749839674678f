"""Bad input and broken parts get a clear error and lose nothing (issue 2, item 6), with real SMPs."""
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from inmem_ft import (BudgetExceeded, ConfigError, LayoutMismatch, SMPUnavailable, SnapshotConfig, Snapshotter)
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control, paths
from inmem_ft.smp.segments import names_with_prefix, path_of


def state(seed=0, n=1000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def test_no_smp_running_is_a_clear_error(job):
    with pytest.raises(SMPUnavailable, match="inmem-ft smp start"):
        Snapshotter(SnapshotConfig(job=job))


def test_smp_death_mid_training_warns_or_raises(job, smp, caplog):
    socket_path, proc = smp
    lenient = Snapshotter(SnapshotConfig(job=job, interval=1))
    strict = Snapshotter(SnapshotConfig(job=job, interval=1, on_error="raise"))
    lenient.save(1, state(1))
    lenient.wait()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lenient.save(2, state(2))  # on_error="warn": training goes on
    lenient.wait()
    assert lenient.metrics.failures == 1 and "stopped answering" in caplog.text
    strict.save(3, state(3))
    with pytest.raises(SMPUnavailable, match="inmem-ft smp start"):
        strict.wait()


TORN_WRITER = textwrap.dedent("""
    import os, signal, sys
    from inmem_ft.smp.client import SMPClient
    from inmem_ft.smp.segments import Segment
    client = SMPClient(sys.argv[1])
    reply = client.call("begin", rank=0, step=2, manifest_len=100, data_len=1 << 20, keep_step=1)
    Segment(reply["segment"]).buf[reply["data_off"]: reply["data_off"] + 4096] = b"x" * 4096
    print("writing", flush=True)
    if sys.argv[2] == "trainer":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
""")


@pytest.mark.parametrize("who_dies", ["trainer", "smp"])
def test_torn_write_is_discarded_and_older_snapshot_served(job, smp, who_dies, runtime):
    socket_path, proc = smp
    snap = Snapshotter(SnapshotConfig(job=job, interval=1))
    snap.save(1, state(1))
    snap.close()
    writer = subprocess.Popen([sys.executable, "-c", TORN_WRITER, socket_path, who_dies], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    if who_dies == "smp":
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        writer.kill()
        control.start(job, 0, 64 << 20)
    writer.wait()
    restored = Snapshotter(SnapshotConfig(job=job)).restore()  # the torn slot is never offered, even before
    assert restored["step"] == 1 and torch.equal(restored["w"], state(1)["w"])  # the SMP notices the hang-up
    expected = "event=torn" if who_dies == "trainer" else "never committed"
    deadline = time.monotonic() + 10  # the SMP logs the discard from its connection thread, asynchronously
    while expected not in open(paths.default_log(job, 0)).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert expected in open(paths.default_log(job, 0)).read()


def test_wrong_world_size_is_refused_and_keeps_the_snapshot(job, runtime):
    with SimulatedCluster(1, 2, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-m", "inmem_ft.examples.plain_pytorch", "--steps", "5", "--interval", "5"])
        assert attempt.ok
        snap = Snapshotter(SnapshotConfig(job=job))  # a job of world size 1 now
        with pytest.raises(LayoutMismatch, match="world size 2"):
            snap.restore()
        assert control.call(cluster.socket_path(0), "list", rank=0)["slots"][0]["step"] == 5


def test_budget_too_small_fails_at_first_snapshot(job):
    control.start(job, 0, 1 << 20)
    try:
        snap = Snapshotter(SnapshotConfig(job=job))
        with pytest.raises(BudgetExceeded, match="--memory-budget"):
            snap.save(1, state(1, n=1 << 18))
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)


def test_budget_larger_than_shm_is_refused_at_start(job):
    with pytest.raises(SMPUnavailable, match="exceeds"):
        control.start(job, 0, 1 << 50)


def test_socket_and_segments_are_owner_only(job, smp):
    socket_path, _ = smp
    with Snapshotter(SnapshotConfig(job=job)) as snap:
        snap.save(1, state(1))
    assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    segments = names_with_prefix(paths.segment_prefix(job, 0))
    assert segments and all(stat.S_IMODE(os.stat(path_of(n)).st_mode) == 0o600 for n in segments)


@pytest.mark.parametrize("values, key", [({"interval": 0}, "interval"), ({"job": "a b"}, "job"),
                                         ({"on_error": "ignore"}, "on_error"),
                                         ({"staging_budget": "lots"}, "staging_budget"),
                                         ({"intervl": 5}, "unknown key")])
def test_bad_config_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        SnapshotConfig.from_dict(values)


def test_completed_step_missing_on_a_rank_fails_clearly_and_keeps_the_rest(job, runtime):
    """A rank whose snapshots are gone (a node lost without erasure coding) must not silently restart the
    job from step 0: the restore fails saying why and how to proceed; start_fresh is the explicit opt-in."""
    example = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", "4", "--interval", "2"]
    with SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs")) as cluster:
        assert cluster.run(example).ok
        cluster.lose_node(1)
        cluster.start_smp(1)  # a replacement with empty memory and no erasure coding to rebuild from
        attempt = cluster.run(example)
        assert not attempt.ok
        log = cluster.rank_log(attempt.number, 0)
        assert "NoUsableSnapshot" in log and "completed step 4" in log and "INMEM_FT_START_FRESH=1" in log
        assert "Traceback" not in log, log
        assert control.call(cluster.socket_path(0), "list", rank=0)["slots"][0]["step"] == 4  # kept
        attempt = cluster.run(example, extra_env={"INMEM_FT_START_FRESH": "1"})
        assert attempt.ok and "starting from scratch" in cluster.rank_log(attempt.number, 0)


RESTORE_WITHOUT_ITS_SMP = """
import torch.distributed as dist
import inmem_ft
from inmem_ft.smp import control
from inmem_ft.teardown import run_main

def main():
    dist.init_process_group("gloo")
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1))
    if dist.get_rank() == 1:
        control.stop(snap.config.socket_path)  # its SMP goes between the trainer's start and its restore
    snap.restore()

run_main(main)
"""


def test_a_rank_whose_smp_refuses_the_restore_fails_it_on_every_rank_with_one_line(job, runtime):
    """A rank that cannot list its snapshots must not raise alone: its peers would wait in the restore's
    agreement until its connection dropped and end with gloo's traceback. Every rank raises its error instead,
    in one line and no traceback."""
    with SimulatedCluster(2, 1, job, 64 << 20, str(runtime / "logs")) as cluster:
        attempt = cluster.run(["-c", RESTORE_WITHOUT_ITS_SMP], timeout_s=120)
        assert not attempt.ok
        said = {}
        for rank, code in attempt.returncodes.items():
            if code == -9:  # stopped by the launcher once the first rank failed
                continue
            log = cluster.rank_log(attempt.number, rank)
            assert code == 1 and "Traceback" not in log, log
            [said[rank]] = [line for line in log.splitlines() if line.startswith("SMPUnavailable: ")]
        assert attempt.first_failure in said and len(set(said.values())) == 1, said
        assert said[attempt.first_failure].startswith("SMPUnavailable: rank 1 cannot restore: the SMP on "), said


def test_smp_keeps_but_never_adopts_another_releases_slot(job, runtime):
    from inmem_ft.smp.segments import Segment
    from inmem_ft.snapshot import flatten, plan, segment as seg

    manifest = {**plan(flatten({"w": torch.zeros(2)}), step=3, rank=0, world_size=1).manifest, "format": "x/9"}
    raw = seg.encode_manifest(manifest)
    name = paths.segment_name(job, 0, 0, 0, 0)
    planted = Segment(name, seg.slot_size(len(raw), 0), create=True)
    planted.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
    seg.Header(seg.COMMITTED, 3, len(raw), seg.data_offset(len(raw)), 0, seg.checksum(raw)).write(planted.buf)
    planted.close()
    control.start(job, 0, 64 << 20)
    try:
        assert control.call(paths.default_socket(job, 0), "list", rank=0)["slots"] == []
        assert "event=unknown_format" in open(paths.default_log(job, 0)).read()
        assert os.path.exists(path_of(name))
        with Snapshotter(SnapshotConfig(job=job)) as snap:  # new slots take other names
            snap.save(1, state(1))
        assert os.path.exists(path_of(name))
    finally:
        control.stop(paths.default_socket(job, 0), wipe=True)
        os.unlink(path_of(name))
