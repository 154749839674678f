"""Snapshotter.resume says what a restart gets as one value (capture/resume.py): nothing, the state restored in
place, or the newest snapshots of another layout to reshard from, through a source that owns what it opened;
either way the losses the snapshot recorded come with it (what the check after a restore learns its bound from)."""
import logging

import pytest
import torch

from inmem_ft import SnapshotConfig, Snapshotter, Topology
from inmem_ft.capture.resume import RestoreInfo
from inmem_ft.errors import LayoutChanged
from inmem_ft.smp import control, paths
from inmem_ft.universal.reshard import FromMemory

ZERO1 = Topology(framework="pytorch", world_size=1, zero_stage=1)
ZERO2 = Topology(framework="pytorch", world_size=1, zero_stage=2)
LOSSES = [2.5, 2.25, 2.0, 2.125]


def test_resume_is_nothing_then_in_place_then_a_reshard_source(job, smp, caplog):
    config = SnapshotConfig(job=job, interval=1)
    with Snapshotter(config) as snap:
        got = snap.resume(layout=ZERO1)
        assert got.nothing and got.info is None
        for step, loss in enumerate(LOSSES):
            snap.observe(step, loss)
        snap.save(1, {"w": torch.arange(4.0)}, topology=ZERO1)
        snap.wait()

    with caplog.at_level(logging.INFO, "inmem_ft"), Snapshotter(config) as snap:
        got = snap.resume(layout=ZERO1)
        assert not got.nothing and got.reshard is None
        assert torch.equal(got.state["w"], torch.arange(4.0))
        assert (got.info.step, got.info.source) == (1, "memory") and snap.last_restore is got.info
        assert got.info.losses == LOSSES
    assert "restore rank=0 step=1 source=memory seconds=" in caplog.text

    with Snapshotter(config) as snap:
        got = snap.resume(layout=ZERO2, reshard=FromMemory.of(snap, ZERO2))
        assert got.state is None and got.reshard.step == 1 and got.reshard.settled  # opened in the agreement
        assert "taken with world size 1 (tp1.pp1.dp1.zero1), this job runs with world size 1 " \
               "(tp1.pp1.dp1.zero2)" in got.reshard.why
        with got.reshard as source:
            rs = source.open()
            assert source.open() is rs  # opened once
            assert rs.step == 1 and torch.equal(rs.job_state("w"), torch.arange(4.0))
            assert RestoreInfo.resharded(rs, 0.0, {}).losses == LOSSES
        with pytest.raises(ValueError, match="closed"):
            source.open()

        # The plain API does not reshard: the clear error, carrying no open resource, and nothing discarded.
        with pytest.raises(LayoutChanged, match="restart with the original layout") as err:
            snap.restore(layout=ZERO2)
        assert err.value.step == 1 and not hasattr(err.value, "opened")
    assert control.call(paths.default_socket(job, 0), "list", rank=0)["slots"][0]["step"] == 1
