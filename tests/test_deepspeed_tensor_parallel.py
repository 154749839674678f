"""Issue 30, item 2: tensor parallelism through an mpu (Megatron-DeepSpeed's way) under the DeepSpeed adapter,
on CPU/gloo with real SMPs, 4 ranks: the example's column/row-parallel GPT (inmem_ft/examples/deepspeed_tp.py)
in TP2 x PP2. kill -9 a rank, restart, resume from memory with the uninterrupted losses bit for bit; the shard
map keys every TP slice as a box of its global tensor; a TP2 snapshot reshards into TP1 (with other PP/DP)
from memory and from the disk tier, every parameter and Adam moment bit-identical to the source's."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.client import SMPClient
from inmem_ft.snapshot import catalog
from inmem_ft.telemetry import read_losses

from conftest import wait_for_log
from ds_harness import free_port

STEPS, INTERVAL = 8, 2
ENV = {"DS_ACCELERATOR": "cpu"}
# The example's layers (2 blocks): the tied token embedding, positions, 2 blocks, the final norm, the tied head.
BLOCK = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
         "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
WEIGHTS = {"layer_00.weight", "layer_01.pos.weight", *(f"layer_{i:02d}.{n}" for i in (2, 3) for n in BLOCK),
           "layer_04.weight", "layer_04.bias"}
KINDS = ("fp32_param", "exp_avg", "exp_avg_sq")
HIDDEN = 64
# (global shape, partition dim) of the split parameters of a block
SPLIT = {"qkv.weight": ((3 * HIDDEN, HIDDEN), 0), "qkv.bias": ((3 * HIDDEN,), 0),
         "proj.weight": ((HIDDEN, HIDDEN), 1), "fc1.weight": ((4 * HIDDEN, HIDDEN), 0),
         "fc1.bias": ((4 * HIDDEN,), 0), "fc2.weight": ((HIDDEN, 4 * HIDDEN), 1)}


def example(tp, pp, *extra, steps=STEPS, stage=1):
    return [str(a) for a in ["-m", "inmem_ft.examples.deepspeed_tp", "--tp", tp, "--pp", pp, "--zero-stage", stage,
                             "--steps", steps, "--interval", INTERVAL, "--hidden", HIDDEN, *extra]]


def run_ok(cluster, argv):
    attempt = cluster.run(argv)
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    return attempt


def entries(cluster, step):
    client = SMPClient(cluster.socket_path(0))
    try:
        table = catalog.fragments(client.catalog()["entries"], step)
    finally:
        client.close()
    catalog.check(table)  # every element of every global tensor is covered by exactly one main fragment
    return table.to_pydict()


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (0, "fp32"), (1, "bf16")])
def test_tp2_pp2_kill_and_resume_bit_identical_and_slices_are_boxes(job, runtime, tmp_path_factory, stage, dtype):
    """TP2 x PP2 on two nodes of two ranks (node 1: the last stage's two TP ranks): the reference run, then a
    run whose TP rank 1 of the last stage is killed after step 5 (snapshots at 2 and 4), and the restart:
    every rank resumes from step 4 in memory and the losses of steps 5-8 equal the reference's bit for bit.
    The shard map holds each split parameter as two boxes of its global shape (one per TP rank), each
    replicated one (layer norms, row-parallel biases, the tied embedding) with one main copy."""
    ref_dir = tmp_path_factory.mktemp("tpref")
    old = os.environ["INMEM_FT_RUNTIME_DIR"]
    os.environ["INMEM_FT_RUNTIME_DIR"] = str(ref_dir / "run")
    try:
        with SimulatedCluster(2, 2, f"{job}r", 256 << 20, str(ref_dir / "logs"), env=ENV) as c:
            run_ok(c, example(2, 2, "--dtype", dtype, "--loss-log", ref_dir / "loss.jsonl", stage=stage))
    finally:
        os.environ["INMEM_FT_RUNTIME_DIR"] = old
    ref = read_losses(ref_dir / "loss.jsonl")
    assert sorted(ref) == list(range(1, STEPS + 1))

    before, resumed = runtime / "before.jsonl", runtime / "resumed.jsonl"
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        attempt = cluster.run(example(2, 2, "--dtype", dtype, "--loss-log", before, "--die-at", 5, "--die-rank", 3,
                                      stage=stage))
        assert not attempt.ok and attempt.returncodes[3] == -9
        assert read_losses(before) == {s: ref[s] for s in range(1, 6)}
        attempt = run_ok(cluster, example(2, 2, "--dtype", dtype, "--loss-log", resumed, stage=stage))
        for rank in range(cluster.world_size):
            assert "step=4 source=memory" in cluster.rank_log(attempt.number, rank)
        cols = entries(cluster, STEPS)
    assert read_losses(resumed) == {s: ref[s] for s in range(5, STEPS + 1)}  # bit-identical

    kinds = KINDS if stage else KINDS[1:]  # ZeRO-0 fp32 steps the weights themselves: no fp32 master
    boxes = {}
    for key, shape, offset, main in zip(cols["key"], cols["global_shape"], cols["offset"], cols["main"]):
        if main and not key.startswith("_"):
            boxes.setdefault(key, set()).add((tuple(shape), tuple(offset)))
    assert set(boxes) == WEIGHTS | {f"optimizer.state.{k}.{w}" for k in kinds for w in WEIGHTS}
    for layer in (2, 3):
        for name, (shape, dim) in SPLIT.items():
            for key in [f"layer_{layer:02d}.{name}", *(f"optimizer.state.{k}.layer_{layer:02d}.{name}" for k in kinds)]:
                offsets = {offset[dim] for got, offset in boxes[key] if got == shape}
                assert offsets == {0, shape[dim] // 2}, (key, boxes[key])


def reshard_and_compare(job, runtime, old, new, *, disk: bool):
    """Snapshots of TP/PP layout `old` (ZeRO-1) on 4 ranks; the restart runs layout `new` on the same ranks,
    from the SMPs' memory or (disk) from the disk tier after every SMP lost its memory and restarted: each rank
    reads the boxes of its own slices by their keys, and every parameter, fp32 master, Adam moment and counter
    equals the old layout's bit for bit (both dumped with TP slices gathered into global tensors)."""
    (old_tp, old_pp), (new_tp, new_pp) = old, new
    smp_args = ["--persist-dir", runtime / "disk", "--persist-every-steps", 4] if disk else []
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV, smp_args=smp_args) as cluster:
        run_ok(cluster, example(old_tp, old_pp, "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        for node in range(cluster.nodes) if disk else ():
            wait_for_log(cluster.smp_log(node), "event=flushed step=4 ")
            cluster.kill_smp(node)
            cluster.wipe_node(node)
            cluster.start_smp(node)
            assert "step=4 from=disk" in open(cluster.smp_log(node)).read()
        attempt = run_ok(cluster, example(new_tp, new_pp, "--dump-full", runtime / "new.pt", "--dump-step", 4,
                                          steps=6))
        dp = {layout: 4 // (layout[0] * max(layout[1], 1)) for layout in (old, new)}
        assert (f"step=4 source=memory_resharded from=tp{old_tp}.pp{old_pp}.dp{dp[old]}.zero1 "
                f"to=tp{new_tp}.pp{new_pp}.dp{dp[new]}.zero1") in cluster.rank_log(attempt.number, 0)
    got, want = torch.load(runtime / "new.pt", weights_only=True), torch.load(runtime / "old.pt", weights_only=True)
    assert got.pop("_counters") == want.pop("_counters")
    assert set(got) == set(want) and len(want) == 4 * len(WEIGHTS)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow
def test_reshard_tp2_pp2_to_tp1_pp2_dp2_from_memory(job, runtime):
    reshard_and_compare(job, runtime, (2, 2), (1, 2), disk=False)


@pytest.mark.slow
def test_reshard_tp2_pp2_to_tp1_pp1_dp4_from_the_disk_tier(job, runtime):
    reshard_and_compare(job, runtime, (2, 2), (1, 1), disk=True)


@pytest.mark.parametrize("stage", [1, pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_plain_module_with_mpu_tp2_resumes_bit_identical(job, runtime, stage):
    """TP2 without a pipeline (the mpu goes to deepspeed.initialize(mpu=...), as Megatron-DeepSpeed passes it
    when it runs no PipelineModule), two ranks on one node: a run of 5 steps (snapshots at 2 and 4), and a
    restart that restores step 4 from memory and trains step 5 again with the same loss. ZeRO-1: every
    parameter, fp32 master, Adam moment and counter after step 5 equals the first run's, and the shard map keys
    the slices by module name as boxes of their global tensors."""
    def run(name):
        dump = ("--dump-full", runtime / f"{name}.pt", "--dump-step", 5) if stage == 1 else ()
        return run_ok(cluster, example(2, 0, "--loss-log", runtime / f"{name}.jsonl", *dump, steps=5,
                                       stage=stage))

    with SimulatedCluster(1, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run("old")
        attempt = run("new")
        for rank in range(cluster.world_size):
            assert "step=4 source=memory" in cluster.rank_log(attempt.number, rank)
        cols = entries(cluster, 4)
    assert read_losses(runtime / "new.jsonl") == {5: read_losses(runtime / "old.jsonl")[5]}
    offsets = {tuple(o) for k, o, m in zip(cols["key"], cols["offset"], cols["main"])
               if k == "optimizer.state.exp_avg.blocks.0.fc2.weight" and m}
    assert offsets == {(0, 0), (0, 2 * HIDDEN)}  # fc2 splits its 4*HIDDEN inputs (dim 1) across the TP ranks
    if stage == 1:
        got, want = torch.load(runtime / "new.pt", weights_only=True), torch.load(runtime / "old.pt", weights_only=True)
        assert got.pop("_counters") == want.pop("_counters")
        assert set(got) == set(want) and "blocks.1.fc2.weight" in want
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_partition_dims_come_from_the_module_else_from_the_config_rules():
    from inmem_ft.config import InmemFTBlock
    from inmem_ft.errors import ConfigError
    from inmem_ft.integrations.deepspeed.tensor_parallel import partition_dim

    marked = torch.nn.Parameter(torch.zeros(4, 8))
    marked.tensor_model_parallel, marked.partition_dim, marked.partition_stride = True, 1, 1
    plain = torch.nn.Parameter(torch.zeros(4, 8))
    rules = InmemFTBlock.from_dict({"partition_dims": {"*.dense.weight": 0, "layer_0?.ln.*": None}}).partition_dims
    assert partition_dim("0.dense.weight", "layer_00.dense.weight", marked, rules) == 1  # the module's mark wins
    assert partition_dim("0.dense.weight", "layer_00.dense.weight", plain, rules) == 0
    assert partition_dim("3.ln.weight", "layer_03.ln.weight", plain, rules) is None  # matched by its key
    assert partition_dim("3.other.weight", "layer_03.other.weight", plain, rules) is None
    with pytest.raises(ConfigError, match="splits 0.dense.weight along dim 2, but it has 2 dims"):
        partition_dim("0.dense.weight", "layer_00.dense.weight", plain, {"*dense*": 2})
    marked.partition_stride = 3
    with pytest.raises(ConfigError, match="partition_stride 3; only contiguous slices"):
        partition_dim("0.dense.weight", "layer_00.dense.weight", marked, None)
    for bad in ({"x": -1}, {"x": "0"}, ["x"], {"": 0}):
        with pytest.raises(ConfigError, match="'partition_dims' = .*must map parameter-name patterns to a dim"):
            InmemFTBlock.from_dict({"partition_dims": bad})


UNMARKED = textwrap.dedent("""
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK=sys.argv[2], LOCAL_RANK=sys.argv[2],
                      WORLD_SIZE="2")
    import torch, deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from inmem_ft.errors import ConfigError
    from inmem_ft.examples.deepspeed_tp import GPT, ModelParallelUnit
    from inmem_ft.integrations.deepspeed import cpu_setup, install
    from inmem_ft.teardown import run_main

    def main():
        torch.set_num_threads(1)
        cpu_setup()
        deepspeed.init_distributed(dist_backend="gloo")
        mpu = ModelParallelUnit(PipeModelDataParallelTopology(1, 2, 1))
        torch.manual_seed(0)
        model = GPT(1, 16, 2, 0.0, mpu)
        del model.blocks[0].fc1.weight.tensor_model_parallel  # a split parameter its module does not mark
        engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), mpu=mpu, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})[0]
        try:
            install(engine, config={"interval": 1})  # refused before the SMP is ever asked
            print("said: accepted")
        except ConfigError as e:
            print("said:", e)

    # The groups go before the interpreter finalizes: a gloo worker freeing the last collective's tensors then
    # would abort the rank (SIGABRT, "terminate called without an active exception"; teardown.py).
    run_main(main)
""")


def test_an_unmarked_split_parameter_is_refused_naming_the_rule_to_add(runtime):
    """TP2, two ranks: a column-parallel weight without Megatron's marks differs across the TP ranks, so
    install() stops on both with a one-line ConfigError that names it and the config rule that would mark it."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", UNMARKED, port, str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        said = [line for line in out.splitlines() if line.startswith("said: ")]
        assert said == ["said: inmem_ft: blocks.0.fc1.weight is not marked as split across tensor-parallel ranks "
                        "(no tensor_model_parallel/partition_dim attributes, no 'partition_dims' rule) but differs "
                        "between them; mark it, or add \"partition_dims\": {\"blocks.0.fc1.weight\": <dim>} to the "
                        "inmem_ft config (if it is meant to be the same on every rank, initialize it the same)"]


@pytest.mark.slow
def test_tp2_pp2_export_loads_in_stock_deepspeed_at_tp2_pp2_and_tp1(job, runtime):
    """TP2 x PP2 (ZeRO-1) exported from memory as a universal checkpoint: stock DeepSpeed ("load_universal":
    true) loads it into the example's TP PipelineModule at TP2 x PP2 (each rank cutting its slices by cat_dim)
    and at TP1 x PP2 and TP1 x PP1 (whole tensors), every parameter, fp32 master and Adam moment equal to the source's
    global tensors (each rank's slice of them), the counters along."""
    from test_export import stock

    out = runtime / "universal"
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run_ok(cluster, example(2, 2, "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        proc = subprocess.run([sys.executable, "-m", "inmem_ft.cli", "export", "--job", job, "--socket",
                               cluster.socket_path(1), "--format", "deepspeed-universal", "--out", str(out),
                               "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(n for n in os.listdir(out / "global_step4") if n.endswith("model_states.pt")) == [
        f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]  # one per (stage, TP rank)
    qkv = torch.load(out / "global_step4" / "zero" / "2.qkv.weight" / "exp_avg.pt", weights_only=True)
    proj = torch.load(out / "global_step4" / "zero" / "2.proj.weight" / "exp_avg.pt", weights_only=True)
    assert (qkv["cat_dim"], tuple(qkv["param"].shape)) == (0, (3 * HIDDEN, HIDDEN))
    assert (proj["cat_dim"], tuple(proj["param"].shape)) == (1, (HIDDEN, HIDDEN))
    truth = torch.load(runtime / "old.pt", weights_only=True)
    truth.pop("_counters")
    for world, tp, pp in ((4, 2, 2), (2, 1, 2), (1, 1, 1)):
        got = stock("ds_universal_load.py", ["--load-dir", out, "--zero-stage", 1, "--truth", runtime / "old.pt",
                                             "--pp", pp, "--tp", tp], world, runtime / f"tp{tp}pp{pp}.json")
        assert got["imported_inmem_ft_beyond_examples"] == []  # the example's model code, none of the snapshot's
        assert got["mismatched"] == [] and got["checked_keys"] == sorted(truth), (tp, pp)
        assert got["global_steps"] == 4 and got["optimizer_steps"] == [4.0]
