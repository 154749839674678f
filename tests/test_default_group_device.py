"""Issue 36, item 5: every collective of inmem_ft's own runs on its own gloo groups, none on the default group.
On a GPU the default group is NCCL, which refuses a host tensor ("No backend type associated with device type
cpu"); a default group made as init_process_group("cuda:gloo") is torch's own dispatch refusing one exactly so,
on a CPU machine. Real processes, a real SMP, a file rendezvous (no port to collide)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

RANK = r"""
import sys, torch, torch.distributed as dist
from inmem_ft import Replicated, SnapshotConfig, Snapshotter
rank, world, rendezvous, job = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("cuda:gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
try:  # the premise: this default group takes no host tensor, as NCCL takes none
    dist.all_reduce(torch.zeros(1))
    sys.exit("the cuda:gloo default group took a host tensor: the test proves nothing")
except RuntimeError as e:
    assert "No backend type associated with device type cpu" in str(e), e
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
gen = torch.Generator().manual_seed(rank)
state = {"model": Replicated(model.state_dict()), "own": torch.full((5,), float(rank)), "rng": {"tp": gen}}
with Snapshotter(SnapshotConfig(job=job, interval=1), dp_group=dist.group.WORLD) as snap:
    snap.save(1, state)
    snap.wait()
with Snapshotter(SnapshotConfig(job=job, interval=1), dp_group=dist.group.WORLD) as snap:
    back = snap.restore()
    assert back is not None and snap.last_restore.step == 1, snap.last_restore
assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
assert torch.equal(back["own"], state["own"])
assert torch.equal(back["rng"]["tp"].get_state(), gen.get_state())
dist.destroy_process_group()
print("ok", rank)
"""


def test_snapshot_and_restore_use_no_default_group(job, smp, tmp_path):
    """Two ranks save a replicated, shared-out state and restore it (replicated shares gathered, steps agreed)
    with a default group that refuses host tensors: every collective of the snapshot's is on its own group."""
    world, rendezvous = 2, tmp_path / "rendezvous"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), str(rendezvous), job], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, f"rank {r} (rc {p.returncode}):\n{out[-4000:]}"
