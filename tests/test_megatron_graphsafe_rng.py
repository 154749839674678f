"""Issue 36, item 7: Megatron's cudagraphable RNG tracker (the shape of Transformer Engine's graph-safe tracker:
a name -> torch.Generator map) through a real snapshot and back, on CPU through tests/megatron_cpu_shim.py (its
graph-safe states are CPU generators). A restored tracker draws exactly what the saved one draws next. Before
Generators were stored as their state, such a state failed the snapshot's vote and the job trained unprotected."""
import os
import subprocess
import sys

from conftest import ROOT

RANK = r"""
import sys
sys.path.insert(0, sys.argv[2])
import megatron_cpu_shim
megatron_cpu_shim.install()
import random, numpy as np, torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from inmem_ft import SnapshotConfig, Snapshotter

job = sys.argv[1]
saved = CudaRNGStatesTracker(use_cudagraphable_rng=True)
saved.add("model-parallel-rng", 1234)
saved.add("data-parallel-rng", 99)
with saved.fork("model-parallel-rng"):
    torch.randn(5)  # past its seed: the state itself must travel
states = saved.get_states()
assert all(isinstance(g, torch.Generator) for g in states.values()), states
# Megatron's rng_state object, as megatron.training.checkpointing.get_rng_state builds it
rng_state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": states}
with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
    snap.save(1, {"rng_state": [rng_state], "w": torch.ones(3)})
    snap.wait()
expected = {}
for name in states:
    with saved.fork(name):
        expected[name] = torch.randn(4)
with Snapshotter(SnapshotConfig(job=job, interval=1)) as snap:
    back = snap.restore()
    assert back is not None and snap.last_restore.step == 1, snap.last_restore
got = back["rng_state"][0]["rng_tracker_states"]
assert sorted(got) == sorted(states) and all(isinstance(g, torch.Generator) for g in got.values()), got
restored = CudaRNGStatesTracker(use_cudagraphable_rng=True)
restored.set_states(got)
for name in states:
    with restored.fork(name):
        assert torch.equal(torch.randn(4), expected[name]), name
print("ok")
"""


def test_graph_safe_tracker_states_roundtrip_through_a_snapshot(job, smp):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", RANK, job, os.path.join(ROOT, "tests")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, f"rc {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
