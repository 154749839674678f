"""Issue 41 for Megatron-Core: a DP shrink from memory under the production agent, TP and PP kept. Three
`inmem-ft run` agents are three nodes (one rank each, their SMPs an EC group with m=1) of the Megatron GPT example
(megatron-core's own pretrain() on CPU, tests/megatron_cpu_shim.py; the distributed optimizer), a global batch of
12 in micro-batches of 2. Node 2 is lost for good after iteration 7 with `--nnodes 2:3`: the survivors go on at
DP 2 from iteration 6, resharded from memory (the lost node's shards from parity), every parameter, fp32 master
and Adam moment right after the restore equal to the 3-node run's at iteration 6, the iteration, consumed samples
and scheduler continuing, the global batch kept by 3 micro-batches instead of 2."""
import argparse
import importlib.util
import json

import pytest
import torch

from inmem_ft.errors import SPARE_EXIT
from inmem_ft.globalbatch import GlobalBatchRefused
from inmem_ft.integrations.megatron.batch import keep_global_batch
from test_elastic import cluster  # noqa: F401  (the three agents as nodes)

if importlib.util.find_spec("megatron") is None:  # not importorskip: importing it needs the shim first
    pytest.skip("megatron-core is not installed (scripts/bootstrap.sh installs it)", allow_module_level=True)

ITERS, INTERVAL, LOST_AT, LOST, STEP = 12, 3, 7, 2, 6  # node 2 lost after iteration 7: 6 resharded
EXAMPLE = ["-m", "inmem_ft.examples.megatron_gpt", "--use-distributed-optimizer", "--num-layers", "1",
           "--micro-batch-size", "2", "--global-batch-size", "12", "--hidden-dropout", "0", "--attention-dropout",
           "0", "--train-iters", str(ITERS), "--inmem-ft", "--inmem-ft-interval", str(INTERVAL)]


@pytest.mark.parametrize("dp, on_shrink, size, scheduler_from_snapshot", [
    (3, "keep", 12, False), (2, "keep", 12, False), (6, "keep", 12, False), (5, "keep", 10, True)])
def test_megatron_keeps_its_global_batch_on_the_new_dp_size_else_on_shrink_decides(dp, on_shrink, size,
                                                                                   scheduler_from_snapshot):
    args = argparse.Namespace(global_batch_size=12, micro_batch_size=2, data_parallel_size=dp,
                              rampup_batch_size=None, use_checkpoint_opt_param_scheduler=False)
    batch = keep_global_batch(args, on_shrink)
    assert args.global_batch_size == size == batch.size and batch.kept == (size == 12)
    # Megatron's micro-batch calculator takes it as it is: micro x DP divides the global batch.
    assert size % (2 * dp) == 0
    # Another global batch changes Megatron's scheduler totals (iterations x batch): the snapshot's go on.
    assert args.use_checkpoint_opt_param_scheduler == scheduler_from_snapshot
    args.data_parallel_size, args.global_batch_size = 5, 12
    with pytest.raises(GlobalBatchRefused, match="does not divide by micro batch 2 x 5") as e:
        keep_global_batch(args, "refuse")
    assert e.value.exit_code == SPARE_EXIT  # inmem-ft run waits for a node to join
    ramp = argparse.Namespace(**{**vars(args), "rampup_batch_size": ["4", "4", "100"]})
    assert keep_global_batch(ramp, "keep") is None and ramp.global_batch_size == 12  # Megatron's own ramp-up


@pytest.mark.slow
def test_megatron_node_lost_for_good_the_survivors_reshard_dp_from_memory_and_keep_the_global_batch(cluster,
                                                                                                    tmp_path):
    from test_megatron_reshard import assemble

    c = cluster("2:3", ["--spare-wait", "1"], example=EXAMPLE)
    dump, log = tmp_path / "state{restart}", tmp_path / "loss.jsonl"
    both = c.shrunk(LOST, ["--loss-log", str(log), "--lose-node-at", str(LOST_AT), "--die-rank", str(LOST),
                           "--dump-state", str(dump), "--dump-at", str(STEP)], 500)
    assert "[example] batch global=12 micro=2 accumulation=2 dp=3" in both
    assert "[example] batch global=12 micro=2 accumulation=3 dp=2" in both  # the global batch kept
    lines = [next(ln for ln in both.splitlines() if f"restore rank={rank} step={STEP} source=memory_resharded" in ln)
             for rank in (0, 1)]
    assert all("from=tp1.pp1.dp3 to=tp1.pp1.dp2" in ln and "bytes_disk" not in ln for ln in lines), lines
    assert any("bytes_parity=" in ln for ln in lines), lines  # the lost node's shards, rebuilt
    # Right after the restore: every global tensor as the 3-node run had it after iteration 6, and the counters.
    before = [torch.load(f"{tmp_path}/state0.rank{r}.pt", weights_only=True) for r in range(3)]
    after = [torch.load(f"{tmp_path}/state1.rank{r}.pt", weights_only=True) for r in range(2)]
    truth, got = assemble(before), assemble(after)
    assert sorted(got) == sorted(truth) and any(k.startswith("optimizer.state.exp_avg_sq.") for k in truth)
    assert [k for k in truth if not torch.equal(got[k], truth[k])] == []
    counters = [d["counters"] for d in before + after]
    assert all(c == counters[0] for c in counters), counters
    assert counters[0]["iteration"] == STEP and counters[0]["consumed_train_samples"] == STEP * 12
    # The data position: iteration 7 again (lost with the node, perhaps logged before), then on to the end.
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps[-(ITERS - STEP):] == list(range(STEP + 1, ITERS + 1)), steps
    assert steps[:-(ITERS - STEP)] in (list(range(1, LOST_AT)), list(range(1, LOST_AT + 1))), steps
