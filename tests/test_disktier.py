"""The SMP's disk tier (smp/disktier.py) with real SMP processes, shared memory and files: periodic flushes of
due complete steps with the last K kept, a torn flush cleaned at start and never adopted, adoption of the
flushed steps into empty memory; and a SIGTERM that lands while a step is being committed (one rank
committed it, the other not yet) flushes that newer step for that rank only, beside the complete step, and
the resume drops it (what tests/test_slurm.py's preemption scenario meets by chance). A snapshot's recorded
losses travel to the disk tier with it: a restore from there screens the steps after it against their bound."""
import json
import os
import signal

import pytest
import torch

from conftest import wait_for_log
from test_sentinel import _train as train
from test_hardening import _write_rank as write_rank
from inmem_ft.capture.snapshotter import Snapshotter
from inmem_ft.config import SnapshotConfig
from inmem_ft.errors import RestoredStateBad, SMPUnavailable
from inmem_ft.smp import control, disktier, inventory, paths
from inmem_ft.smp.client import SMPClient
from inmem_ft.snapshot import segment as seg

DISK = disktier.SOURCE


@pytest.fixture
def smp_with_disk(job, runtime):
    """start(*args): node 0's SMP with its disk tier in runtime/disk -> (base, socket, log); stopped (wiped)
    at the end whatever the test did."""
    base, sock, log = runtime / "disk", paths.default_socket(job, 0), paths.default_log(job, 0)

    def start(*args):
        control.start(job, 0, 64 << 20, extra_args=["--persist-dir", str(base), *args])
        return base, sock, log
    yield start
    if control.ping(sock):
        control.stop(sock, wipe=True)


def steps(client, rank):
    return [(slot["step"], slot["source"]) for slot in client.call("list", rank=rank)["slots"]]


def test_periodic_flush_keeps_the_last_k_and_a_torn_flush_is_never_adopted(job, runtime, smp_with_disk):
    base, sock, log = smp_with_disk("--persist-every-steps", "2", "--persist-keep", "2")
    node = base / job / "node0"
    client = SMPClient(sock)
    try:
        keep, data = None, {}
        for step in (2, 3, 4, 6):  # 3 is not due
            for rank in (0, 1):
                data[rank, step] = write_rank(sock, rank, step, keep)
            client.call("complete", step=step)
            keep = step
            if step % 2 == 0:
                wait_for_log(log, f"event=flushed step={step} ranks=0,1 ", timeout=20)
        assert sorted(os.listdir(node)) == ["r0.step4.slot", "r0.step6.slot", "r1.step4.slot", "r1.step6.slot",
                                            "step4.done", "step6.done"]
        assert json.loads((base / job / "latest").read_text()) == {"step": 6}
        raw = bytearray((node / "r1.step6.slot").read_bytes())
        header, _ = seg.verify(memoryview(raw), "r1.step6.slot")  # the slot's own checksums
        assert raw[header.data_off:] == data[1, 6]
    finally:
        client.close()

    # A flush killed half-way: a temporary file, and a slot file its marker never named.
    (node / "r0.step8.slot").write_bytes(b"torn")
    (node / "r0.step8.slot.1234.inmem_ft.tmp").write_bytes(b"torn")
    control.stop(sock, wipe=True)  # and the node's memory is gone
    smp_with_disk("--persist-every-steps", "2", "--persist-keep", "2")
    client = SMPClient(sock)
    try:
        text = open(log).read()
        assert "event=clean file=r0.step8.slot reason=no flush marker names it" in text
        assert "event=clean file=r0.step8.slot.1234.inmem_ft.tmp reason=temporary file" in text
        assert not (node / "r0.step8.slot").exists()
        assert steps(client, 0) == [(6, DISK), (4, DISK)] and steps(client, 1) == [(6, DISK), (4, DISK)]
    finally:
        client.close()


def test_bad_disk_tier_settings_are_a_clear_error(smp_with_disk):
    with pytest.raises(SMPUnavailable, match=r"--persist-keep 0: must be >= 1"):
        smp_with_disk("--persist-keep", "0")


def test_sigterm_mid_commit_flushes_the_newer_step_for_its_rank_only_and_the_resume_drops_it(job, runtime):
    disk_args = ["--persist-dir", str(runtime / "disk")]  # no --persist-every-steps: only SIGTERM flushes
    sock, log = paths.default_socket(job, 0), paths.default_log(job, 0)
    smp = control.start(job, 0, 64 << 20, extra_args=disk_args)
    try:
        for rank in (0, 1):
            write_rank(sock, rank, 8, None)
        client = SMPClient(sock)
        client.call("complete", step=8)
        client.close()
        write_rank(sock, 0, 10, 8)  # rank 0 committed step 10; rank 1 has not when the SIGTERM comes
        smp.send_signal(signal.SIGTERM)
        assert smp.wait(timeout=60) == 0
    finally:
        if smp.poll() is None:
            smp.kill()
    assert sorted(os.listdir(disktier.node_dir(str(runtime / "disk"), job, 0))) == [
        "r0.step10.slot", "r0.step8.slot", "r1.step8.slot", "step10.done", "step8.done"]
    assert "event=spill steps=8,10 files=3" in open(log).read()

    inventory.remove(job, 0)  # the node's memory is gone
    control.start(job, 0, 64 << 20, extra_args=disk_args)
    client = SMPClient(sock)
    try:
        assert steps(client, 0) == [(10, DISK), (8, DISK)]
        assert steps(client, 1) == [(8, DISK)]
        client.call("restored", rank=0, step=8)  # step 8 is the newest step every rank holds
        assert steps(client, 0) == [(8, DISK)]
        assert "event=discard rank=0 step=10 reason=job resumed from step 8" in open(log).read()
    finally:
        client.close()
        control.stop(sock, wipe=True)


def test_a_restore_from_the_disk_tier_learns_the_bound_from_the_recorded_losses(job, smp_with_disk):
    base, sock, log = smp_with_disk("--persist-every-steps", "6")  # one flush: no snapshot skipped for its lag
    config = SnapshotConfig(job=job, interval=2, sentinel_steps=5)
    with Snapshotter(config) as snap:
        train(snap, torch.zeros(4), 1, 6, lambda s: 3.0 - 0.1 * s)
    wait_for_log(log, "event=flushed step=6 ", timeout=20)
    control.stop(sock, wipe=True)  # the node's memory and the SMP's records beside the slots are gone
    smp_with_disk("--persist-every-steps", "6")
    with Snapshotter(config) as snap:
        state = snap.restore()
        assert (snap.last_restore.step, snap.last_restore.source) == (6, DISK)
        assert torch.equal(state["w"], torch.full((4,), 6.0))
        assert snap.last_restore.losses == pytest.approx([3.0 - 0.1 * s for s in range(1, 7)])
        snap.observe(7, torch.tensor(2.35))
        with pytest.raises(RestoredStateBad, match=r"step 8 after the restore from step 6: loss 9 above the bound"):
            snap.observe(8, torch.tensor(9.0))
