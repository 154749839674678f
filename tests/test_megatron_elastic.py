"""Issue 41 for Megatron-Core: a DP shrink from memory under the production agent, TP and PP kept. Three
`inmem-ft run` agents are three nodes (one rank each, their SMPs an EC group with m=1) of the Megatron GPT example
(megatron-core's own pretrain() on CPU, tests/megatron_cpu_shim.py; the distributed optimizer), a global batch of
12 in micro-batches of 2. Node 2 is lost for good after iteration 7 with `--nnodes 2:3`: the survivors go on at
DP 2 from iteration 6, resharded from memory (the lost node's shards from parity), every parameter, fp32 master
and Adam moment right after the restore equal to the 3-node run's at iteration 6, the iteration, consumed samples
and scheduler continuing, the global batch kept by 3 micro-batches instead of 2. Node 2 joining back later: the job
grows to DP 3 at the next snapshot, resharded from memory the same way. A global batch that does not divide on
the new DP size: fitted (on_shrink keep) or refused (exit code 75) with one line as Megatron's arguments are
parsed, before Megatron's own checks could assert."""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from inmem_ft.errors import SPARE_EXIT
from inmem_ft.globalbatch import GlobalBatchRefused
from inmem_ft.integrations.megatron.args import add_args
from inmem_ft.integrations.megatron.batch import keep_global_batch
from test_elastic import cluster  # noqa: F401  (the three agents as nodes)

if importlib.util.find_spec("megatron") is None:  # not importorskip: importing it needs the shim first
    pytest.skip("megatron-core is not installed (scripts/bootstrap.sh installs it)", allow_module_level=True)

ITERS, INTERVAL, LOST_AT, LOST, STEP = 12, 3, 7, 2, 6  # node 2 lost after iteration 7: 6 resharded
EXAMPLE = ["-m", "inmem_ft.examples.megatron_gpt", "--use-distributed-optimizer", "--num-layers", "1",
           "--micro-batch-size", "2", "--global-batch-size", "12", "--hidden-dropout", "0", "--attention-dropout",
           "0", "--train-iters", str(ITERS), "--inmem-ft", "--inmem-ft-interval", str(INTERVAL)]


def parsed(world: int, *argv: str, monkeypatch):
    """argv parsed as Megatron's parse_args parses it at $WORLD_SIZE `world`: by a parser with Megatron's batch
    and model-parallel arguments and ours (add_args)."""
    parser = argparse.ArgumentParser()
    for name in ("--global-batch-size", "--micro-batch-size"):
        parser.add_argument(name, type=int, default=None)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        parser.add_argument(name, type=int, default=1)
    parser.add_argument("--rampup-batch-size", nargs="*", default=None)
    parser.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")
    add_args(parser)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return parser.parse_args(["--global-batch-size", "12", "--micro-batch-size", "2", *argv])


@pytest.mark.parametrize("world, tp, size, scheduler_from_snapshot", [
    (3, 1, 12, False), (2, 1, 12, False), (6, 1, 12, False), (5, 1, 10, True), (10, 2, 10, True)])
def test_megatron_keeps_its_global_batch_on_the_new_dp_size_before_megatron_validates_it(world, tp, size,
                                                                                        scheduler_from_snapshot,
                                                                                        monkeypatch):
    args = parsed(world, "--inmem-ft", "--tensor-model-parallel-size", str(tp), monkeypatch=monkeypatch)
    # Megatron's checks (validate_args, its micro-batch calculator) take it as it is: micro x DP divides it.
    assert args.global_batch_size == size and size % (2 * world // tp) == 0
    # Another global batch changes Megatron's scheduler totals (iterations x batch): the snapshot's go on.
    assert args.use_checkpoint_opt_param_scheduler == scheduler_from_snapshot
    batch = keep_global_batch(argparse.Namespace(**{**vars(args), "global_batch_size": 12}), "keep", world // tp)
    assert (batch.size, batch.kept) == (size, size == 12)


def test_megatron_global_batch_that_does_not_divide_on_shrink_refuse_waits_else_megatron_settles_it(monkeypatch):
    with pytest.raises(GlobalBatchRefused, match="does not divide by micro batch 2 x 5") as e:
        parsed(5, "--inmem-ft", "--inmem-ft-on-shrink", "refuse", monkeypatch=monkeypatch)
    assert e.value.exit_code == SPARE_EXIT  # inmem-ft run waits for a node to join
    assert parsed(5, monkeypatch=monkeypatch).global_batch_size == 12  # no --inmem-ft: not ours
    assert parsed(5, "--inmem-ft", "--rampup-batch-size", "4", "4", "100",
                  monkeypatch=monkeypatch).global_batch_size == 12  # Megatron's own ramp-up
    # Megatron's own check names a world size that no model-parallel layout divides.
    assert parsed(5, "--inmem-ft", "--tensor-model-parallel-size", "2", monkeypatch=monkeypatch).global_batch_size == 12


def assert_dumped_alike(before: list[dict], after: list[dict], iteration: int) -> None:
    """The example's --dump-state of one iteration on two layouts: every global tensor (parameters, fp32 masters,
    Adam moments) equal, and the counters (iteration, consumed samples at a global batch of 12, scheduler, Adam
    steps)."""
    from test_megatron_reshard import assemble

    truth, got = assemble(before), assemble(after)
    assert sorted(got) == sorted(truth) and any(k.startswith("optimizer.state.exp_avg_sq.") for k in truth)
    assert [k for k in truth if not torch.equal(got[k], truth[k])] == []
    counters = [d["counters"] for d in before + after]
    assert all(c == counters[0] for c in counters), counters
    assert counters[0]["iteration"] == iteration and counters[0]["consumed_train_samples"] == iteration * 12


@pytest.mark.slow
def test_megatron_node_lost_for_good_the_survivors_reshard_dp_from_memory_and_keep_the_global_batch(cluster,
                                                                                                    tmp_path):
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
    assert_dumped_alike(before, after, STEP)
    # The data position: iteration 7 again (lost with the node, perhaps logged before), then on to the end.
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps[-(ITERS - STEP):] == list(range(STEP + 1, ITERS + 1)), steps
    assert steps[:-(ITERS - STEP)] in (list(range(1, LOST_AT)), list(range(1, LOST_AT + 1))), steps


@pytest.mark.slow
def test_megatron_node_that_joins_after_a_shrink_is_taken_in_at_the_next_snapshot_from_memory(cluster, tmp_path):
    """After the shrink to DP 2, node 2 starts again (a new agent, an empty SMP): the agents take it in at the next
    snapshot, and the three ranks reshard that iteration from DP 2 onto DP 3 from memory: every tensor right after
    the restore equal to the DP 2 run's at that iteration, the counters continuing, the global batch kept."""
    c = cluster("2:3", ["--spare-wait", "1"], example=EXAMPLE)
    dump, log = tmp_path / "state.world{world}.it{iteration}", tmp_path / "loss.jsonl"
    grown = c.grown(LOST, ["--loss-log", str(log), "--train-iters", "100000", "--lose-node-at", str(LOST_AT),
                           "--die-rank", str(LOST), "--dump-state", str(dump),
                           "--dump-at", f"{STEP + INTERVAL}::{INTERVAL}"],
                    ("tp1.pp1.dp2", "tp1.pp1.dp3"), log, 600)
    out = c.out(0)
    assert out.count("[example] batch global=12 micro=2 accumulation=2 dp=3") == 2, out  # at the start, grown
    assert "[example] batch global=12 micro=2 accumulation=3 dp=2" in out
    assert all("bytes_disk" not in ln for ln in c.out(LOST).splitlines() if f"step={grown} source=" in ln)
    # Right after the restore on DP 3: every global tensor as the DP 2 run had it after that iteration, and the
    # counters (the 3-node run before the shrink never got that far).
    before, after = ([torch.load(f"{tmp_path}/state.world{world}.it{grown}.rank{r}.pt", weights_only=True)
                      for r in range(world)] for world in (2, 3))
    assert_dumped_alike(before, after, grown)


@pytest.mark.slow
@pytest.mark.parametrize("on_shrink", ["keep", "refuse"])
def test_megatron_global_batch_that_does_not_divide_on_the_new_dp_size_gets_one_line_no_assertion(runtime, job,
                                                                                                 monkeypatch,
                                                                                                 on_shrink):
    """The Megatron example as one rank of 5 (DP 5 after a shrink; nothing else started, so it goes only as far
    as its process group): with keep, Megatron's own validation and micro-batch calculator take the global batch
    of 10 we said; with refuse, one line and exit code 75, before any process group."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the process group then fails at once, past the batch
        monkeypatch.delenv(name, raising=False)
    proc = subprocess.run([sys.executable, *EXAMPLE, "--inmem-ft-on-shrink", on_shrink, "--inmem-ft-job", job],
                          cwd=runtime, env={**os.environ, "WORLD_SIZE": "5", "RANK": "0", "LOCAL_RANK": "0"},
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "global batch 12 does not divide by micro batch 2 x 5" in ln]
    assert len(said) == 1, out[-4000:]
    assert "AssertionError" not in out, out[-4000:]
    if on_shrink == "refuse":
        assert proc.returncode == SPARE_EXIT and said[0].startswith("GlobalBatchRefused: "), out[-4000:]
        assert "Traceback" not in out and "[example] batch" not in out, out[-4000:]
    else:
        assert "a global batch of 10" in said[0], said
        assert "[example] batch global=10 micro=2 accumulation=1 dp=5" in out, out[-4000:]


@pytest.mark.slow
def test_megatron_on_shrink_refuse_waits_for_a_node_to_join_and_goes_on_with_it(cluster, tmp_path):
    """A global batch of 6 in micro-batches of 2 does not divide at DP 2: with refuse, the survivors of node 2's
    loss exit with SPARE_EXIT as Megatron's arguments are parsed (no assertion), the agents wait until node 2 comes
    back, and the job goes on at DP 3 from iteration 6, never having trained on another global batch."""
    c = cluster("2:3", ["--spare-wait", "1"], example=EXAMPLE)
    log = tmp_path / "loss.jsonl"
    out = c.refused(LOST, ["--global-batch-size", "6", "--inmem-ft-on-shrink", "refuse", "--loss-log", str(log)])
    survivors = out + c.out(1)
    assert "GlobalBatchRefused: inmem_ft: global batch 6 does not divide by micro batch 2 x 2" in survivors
    assert "AssertionError" not in survivors, survivors[-4000:]
    assert out.count("[example] batch global=6 micro=2 accumulation=1 dp=3") == 2  # at the start, and back at 3
    assert not re.search(r"\[example\] batch .* dp=2$", out, re.M)  # never trained on another global batch
    assert re.search(rf"restore rank=2 step={STEP} source=(peer_reconstruction|memory) ", c.out(LOST)), \
        c.out(LOST)[-4000:]
    steps = [json.loads(line)["step"] for line in open(log)]
    assert steps[-(ITERS - STEP):] == list(range(STEP + 1, ITERS + 1)), steps
    assert steps[:-(ITERS - STEP)] in (list(range(1, LOST_AT)), list(range(1, LOST_AT + 1))), steps
