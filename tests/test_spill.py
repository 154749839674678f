"""The SMP's disk spill (smp/spill.py) with real SMP processes: a SIGTERM that lands while a step is being
committed (one rank committed it, the other not yet) spills that newer step for that rank only, beside the
complete step; a new SMP with nothing in memory adopts both, and the newer one is dropped once the job
resumes from the step every rank holds (what tests/test_slurm.py's preemption scenario meets by chance)."""
import os
import signal

from test_hardening import _write_rank as write_rank
from inmem_ft.smp import control, inventory, paths, spill
from inmem_ft.smp.client import SMPClient


def steps(client, rank):
    return [(slot["step"], slot["source"]) for slot in client.call("list", rank=rank)["slots"]]


def test_sigterm_mid_commit_spills_the_newer_step_for_its_rank_only_and_the_resume_drops_it(job, runtime):
    spill_args = ["--spill-dir", str(runtime / "spill")]
    sock, log = paths.default_socket(job, 0), paths.default_log(job, 0)
    smp = control.start(job, 0, 64 << 20, extra_args=spill_args)
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
    assert sorted(os.listdir(spill.node_dir(str(runtime / "spill"), job, 0))) == [
        "r0.step10.slot", "r0.step8.slot", "r1.step8.slot"]
    assert "event=spill steps=8,10 files=3" in open(log).read()

    inventory.remove(job, 0)  # the node's memory is gone
    control.start(job, 0, 64 << 20, extra_args=spill_args)
    client = SMPClient(sock)
    try:
        assert steps(client, 0) == [(10, spill.SOURCE), (8, spill.SOURCE)]
        assert steps(client, 1) == [(8, spill.SOURCE)]
        client.call("restored", rank=0, step=8)  # step 8 is the newest step every rank holds
        assert steps(client, 0) == [(8, spill.SOURCE)]
        assert "event=discard rank=0 step=10 reason=job resumed from step 8" in open(log).read()
    finally:
        client.close()
        control.stop(sock, wipe=True)
