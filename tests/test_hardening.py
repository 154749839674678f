"""Hardening (issue 11): SMP restarts, corruption, hostile control frames and EC lag, against real SMP
daemons, real sockets and real /dev/shm."""
import signal

import torch

from inmem_ft import SnapshotConfig, Snapshotter
from inmem_ft.smp import control, paths


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
