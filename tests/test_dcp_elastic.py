"""Issue 41 for the DCP backend: the FSDP2 example (inmem_ft.dcp.Checkpointer) under three `inmem-ft run` agents,
one rank each, their SMPs an EC group with m=1, a global batch of 24 rows (8 a rank). Node 2 is lost for good
after step 7 with `--nnodes 2:3`: the survivors load step 6 onto 2 ranks from memory with DCP's own resharding
planner, the lost rank's chunks read through parity; the whole state right after the load equals the 3-rank
run's at step 6, and the global batch is kept with 12 rows a rank, the data position continuing."""
import json

import pytest
import torch

from test_elastic import cluster  # noqa: F401  (the three agents as nodes)

STEPS, INTERVAL, LOST_AT, LOST, STEP = 12, 3, 7, 2, 6
EXAMPLE = ["-m", "inmem_ft.examples.fsdp2_dcp", "--steps", str(STEPS), "--interval", str(INTERVAL),
           "--global-batch", "24"]


@pytest.mark.slow
def test_dcp_node_lost_for_good_the_survivors_load_onto_fewer_ranks_from_memory(cluster, tmp_path):
    c = cluster("2:3", ["--spare-wait", "1"], example=EXAMPLE)
    dump, log = tmp_path / "state{restart}.pt", tmp_path / "loss.jsonl"
    both = c.shrunk(LOST, ["--loss-log", str(log), "--lose-node-at", str(LOST_AT), "--die-rank", str(LOST),
                           "--dump-full", str(dump), "--dump-step", str(STEP)], 300)
    assert "[example] world=3 global_batch=24 rows_per_rank=8 next_batch=1" in both
    assert f"[example] world=2 global_batch=24 rows_per_rank=12 next_batch={STEP + 1}" in both
    restores = [ln for ln in both.splitlines() if f"step={STEP} source=dcp-" in ln]
    assert len(restores) == 2 and "disk" not in "".join(restores), restores
    assert any("parity" in ln for ln in restores), restores  # the lost rank's chunks, decoded
    before, after = (torch.load(str(dump).format(restart=r), weights_only=True) for r in (0, 1))
    assert sorted(before["tensors"]) == sorted(after["tensors"]) and len(before["tensors"]) > 10
    assert [k for k in before["tensors"] if not torch.equal(before["tensors"][k], after["tensors"][k])] == []
    assert before["counters"] == after["counters"]  # step, data position, scheduler
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps[-(STEPS - STEP):] == list(range(STEP + 1, STEPS + 1)), steps
    assert steps[:-(STEPS - STEP)] in (list(range(1, LOST_AT)), list(range(1, LOST_AT + 1))), steps
