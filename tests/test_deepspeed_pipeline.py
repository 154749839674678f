"""Issue 30, item 1: DeepSpeed's pipeline engine (PipelineModule, ZeRO-0/1) protected by inmem_ft, on CPU/gloo
with real SMPs: a tied embedding/LM head on the first and last stage, dropout on every stage, a data iterator
with a position. kill -9 a rank, restart, resume from memory with the losses of the uninterrupted run bit for
bit; the shard map keys every parameter by its layer index, whichever stage holds it. train_batch()'s loss reaches
the check after a restore (issue 40)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import wait_for_log
from ds_harness import free_port
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.client import SMPClient
from inmem_ft.snapshot import catalog
from inmem_ft.telemetry import read_losses
from inmem_ft.universal.assemble import keys

STEPS, INTERVAL = 10, 2
ENV = {"DS_ACCELERATOR": "cpu"}
# The example's layers (2 blocks): the tied token embedding, positions, 2 blocks, the final norm, the tied head.
BLOCK = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
         "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]
WEIGHTS = {"layer_00.weight", "layer_01.pos.weight", *(f"layer_{i:02d}.{n}" for i in (2, 3) for n in BLOCK),
           "layer_04.weight", "layer_04.bias"}


def example(pp, stage, dtype="fp32", *extra, steps=STEPS):
    return [str(a) for a in ["-m", "inmem_ft.examples.deepspeed_pipe", "--pp", pp, "--zero-stage", stage,
                             "--dtype", dtype, "--steps", steps, "--interval", INTERVAL, *extra]]


def run_ok(cluster, argv):
    attempt = cluster.run(argv)
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    return attempt


def reference(nodes, per_node, pp, stage, dtype, tmp_path_factory):
    """The uninterrupted run's losses (its own job, runtime directory and SMPs)."""
    tmp = tmp_path_factory.mktemp(f"ref{pp}{stage}{dtype}")
    old = os.environ.get("INMEM_FT_RUNTIME_DIR")
    os.environ["INMEM_FT_RUNTIME_DIR"] = str(tmp / "run")
    try:
        with SimulatedCluster(nodes, per_node, f"ref{pp}{stage}{os.getpid()}", 256 << 20, str(tmp / "logs"),
                              env=ENV) as c:
            run_ok(c, example(pp, stage, dtype, "--loss-log", tmp / "loss.jsonl"))
    finally:
        if old is None:
            del os.environ["INMEM_FT_RUNTIME_DIR"]
        else:
            os.environ["INMEM_FT_RUNTIME_DIR"] = old
    losses = read_losses(tmp / "loss.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def crash_and_resume(cluster, runtime, ref, pp, stage, dtype, die_rank, extra=()):
    """Killed after step 7 (snapshots at 2, 4, 6): the restart resumes at step 7, bit-identical."""
    before = runtime / "before.jsonl"
    attempt = cluster.run(example(pp, stage, dtype, "--loss-log", before, "--die-at", 7, "--die-rank", die_rank))
    assert not attempt.ok and attempt.returncodes[die_rank] == -9
    assert read_losses(before) == {s: ref[s] for s in range(1, 8)}
    resumed = runtime / "resumed.jsonl"
    attempt = run_ok(cluster, example(pp, stage, dtype, "--loss-log", resumed, *extra))
    for rank in range(cluster.world_size):
        assert "step=6 source=memory" in cluster.rank_log(attempt.number, rank)
    assert read_losses(resumed) == {s: ref[s] for s in range(7, STEPS + 1)}  # bit-identical
    return attempt


def shard_keys(cluster, step):
    """The global keys of the job's snapshot of `step`, after checking every one is covered exactly once by
    main fragments."""
    client = SMPClient(cluster.socket_path(0))
    try:
        listing = client.catalog()
        table = catalog.fragments(listing["entries"], step)
        catalog.check(table)
        return {k for k in keys(table) if not k.startswith("_")}
    finally:
        client.close()


@pytest.mark.parametrize("stage", [1])
def test_pp2_kill_and_resume_bit_identical_and_keys_by_layer(job, runtime, tmp_path_factory, stage):
    """PP2 x DP1 on two nodes: the last stage (holding the LM head, tied to the first stage's embedding) is
    killed; the shard map names the tied weight once, at its first layer, with one main copy. The explicit
    save_checkpoint at the end writes DeepSpeed's own pipeline checkpoint (layer files and one model-states
    file per stage)."""
    ref = reference(2, 1, 2, stage, "fp32", tmp_path_factory)
    stock = runtime / "stock"
    with SimulatedCluster(2, 1, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        crash_and_resume(cluster, runtime, ref, 2, stage, "fp32", die_rank=1, extra=("--save-dir", stock))
        got = shard_keys(cluster, STEPS)
    assert (stock / "latest").read_text() == f"global_step{STEPS}"
    assert {"layer_00-model_states.pt", "layer_04-model_states.pt", "mp_rank_00_model_states.pt",
            "mp_rank_01_model_states.pt"} <= set(os.listdir(stock / f"global_step{STEPS}"))
    optimizer = {f"optimizer.state.{kind}.{k}" for kind in ("fp32_param", "exp_avg", "exp_avg_sq") for k in WEIGHTS}
    assert got == WEIGHTS | optimizer


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (0, "fp32"), (1, "bf16")])
def test_pp2_dp2_kill_and_resume_bit_identical(job, runtime, tmp_path_factory, stage, dtype):
    """PP2 x DP2 on two nodes of two ranks (node 1 holds the last stage): DP replicas split their stage's
    weights and model states, ZeRO-1 its optimizer; a rank of the last stage is killed."""
    ref = reference(2, 2, 2, stage, dtype, tmp_path_factory)
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        crash_and_resume(cluster, runtime, ref, 2, stage, dtype, die_rank=3)
        got = shard_keys(cluster, STEPS)
    kinds = ("exp_avg", "exp_avg_sq") + (("fp32_param",) if stage else ())  # ZeRO-0 fp32 steps the weights
    assert got == WEIGHTS | {f"optimizer.state.{kind}.{k}" for kind in kinds for k in WEIGHTS}


@pytest.mark.slow
def test_pp2_dp2_lost_node_rebuilt_from_parity_resumes_bit_identical(job, runtime, monkeypatch):
    """PP2 x DP2 on four one-rank nodes with one parity share: after step 9 the node of the last stage's second
    replica is lost (trainer and SMP killed, memory wiped) and replaced by an empty SMP, which rebuilds its
    snapshot from the group; the restart resumes from it and repeats the crashed run's steps bit for bit."""
    from test_ec_resume import settled_step

    monkeypatch.setenv("INMEM_FT_SECRET", "pipeline-test-secret-0123456789")
    cluster = SimulatedCluster(4, 1, job, 64 << 20, str(runtime / "logs"), env=ENV, parity=1).start()
    try:
        before, resumed = runtime / "before.jsonl", runtime / "resumed.jsonl"
        attempt = cluster.run(example(2, 1, "fp32", "--loss-log", before, "--die-at", 9, "--die-rank", 3))
        assert not attempt.ok and attempt.returncodes[3] == -9
        step = settled_step(cluster)
        assert step in (6, 8), step
        cluster.lose_node(3)
        cluster.start_smp(3)
        attempt = run_ok(cluster, example(2, 1, "fp32", "--loss-log", resumed))
        assert f"event=rebuilt step={step}" in open(cluster.smp_log(3)).read()
        assert f"step={step} source=peer_reconstruction" in cluster.rank_log(attempt.number, 3)
    finally:
        cluster.stop()
    before, resumed = read_losses(before), read_losses(resumed)
    assert min(resumed) == step + 1
    assert {s: resumed[s] for s in range(step + 1, 10)} == {s: before[s] for s in range(step + 1, 10)}


@pytest.mark.slow
def test_a_pipeline_snapshot_into_a_model_without_stages_is_refused_clearly(job, runtime):
    """Snapshots of PP2 x DP1; the restart builds a plain (non-pipeline) model: every rank stops with a
    one-line ConfigError before training (a pipeline snapshot's keys name layers, not that model's
    parameters)."""
    with SimulatedCluster(2, 1, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run_ok(cluster, example(2, 1, "fp32", steps=4))
        attempt = cluster.run(["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "1", "--steps", "6",
                               "--interval", str(INTERVAL), "--loss-log", str(runtime / "resumed.jsonl")])
        assert not attempt.ok and read_losses(runtime / "resumed.jsonl") == {}
        said = cluster.rank_log(attempt.number, attempt.first_failure or 0)
        assert "ConfigError: inmem_ft: the snapshot was taken with 2 pipeline stages and this model is no " \
               "PipelineModule" in said


def reshard_and_compare(job, runtime, nodes, per_node, old_pp, new_pp, dtype="fp32", from_disk=False):
    """Snapshots of one pipeline layout (ZeRO-1); the restart builds the same PipelineModule in another number
    of stages on the same ranks: each rank reads its flat ranges of every layer's fp32 master and moments by
    their layer keys, and every parameter, master, moment and counter equals the old layout's bit for bit.
    `from_disk`: the SMPs flushed the snapshot to their disk tier and were wiped; the new SMPs adopt it from
    the files, and the export of those files (`inmem-ft export --from`) loads in stock DeepSpeed at PP1."""
    world = nodes * per_node
    disk = runtime / "disk"
    with SimulatedCluster(nodes, per_node, job, 256 << 20, str(runtime / "logs"), env=ENV,
                          smp_args=["--persist-dir", disk, "--persist-every-steps", 4] if from_disk else ()) as cluster:
        run_ok(cluster, example(old_pp, 1, dtype, "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        if from_disk:
            for node in range(nodes):
                wait_for_log(cluster.smp_log(node), "event=flushed step=4 ")
                cluster.kill_smp(node)
                cluster.wipe_node(node)
                cluster.start_smp(node)
                assert "step=4 from=disk" in open(cluster.smp_log(node)).read()
            export_and_load(runtime, ["--from", disk], "disk", [(1, 1)])
        attempt = run_ok(cluster, example(new_pp, 1, dtype, "--dump-full", runtime / "new.pt", "--dump-step", 4,
                                          steps=6))
        assert (f"step=4 source=memory_resharded from=tp1.pp{old_pp}.dp{world // old_pp}.zero1 "
                f"to=tp1.pp{new_pp}.dp{world // new_pp}.zero1") in cluster.rank_log(attempt.number, 0)
    old, new = torch.load(runtime / "old.pt", weights_only=True), torch.load(runtime / "new.pt", weights_only=True)
    assert old.pop("_counters") == new.pop("_counters")
    assert set(old) == set(new) and len(old) == 4 * len(WEIGHTS)
    for key, want in old.items():
        assert torch.equal(new[key], want), key


def test_reshard_pp2_to_pp1_bit_identical(job, runtime):
    reshard_and_compare(job, runtime, 2, 1, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("nodes,per_node,old_pp,new_pp,dtype", [(2, 1, 1, 2, "fp32"), (2, 2, 2, 1, "fp32"),
                                                                 (2, 1, 2, 1, "bf16")])
def test_reshard_pipeline_layouts_bit_identical(job, runtime, nodes, per_node, old_pp, new_pp, dtype):
    """PP1 x DP2 -> PP2 x DP1, and PP2 x DP2 -> PP1 x DP4 (the tied embedding's two copies become one); bf16."""
    reshard_and_compare(job, runtime, nodes, per_node, old_pp, new_pp, dtype)


@pytest.mark.slow
def test_reshard_pp2_dp2_to_pp1_dp4_from_the_disk_tier(job, runtime):
    """Memory gone (every SMP killed and wiped): PP2 x DP2 -> PP1 x DP4 from the files the SMPs persisted."""
    reshard_and_compare(job, runtime, 2, 2, 2, 1, from_disk=True)


# ---- export to DeepSpeed's universal checkpoint, loaded by stock DeepSpeed ------------------------------------

def export_and_load(runtime, where: list, name: str, loads, stages=2) -> None:
    """`inmem-ft export --format deepspeed-universal` of step 4 (`where`: --job/--socket, or --from DIR), then
    stock DeepSpeed loads it ("load_universal": true) into the example's PipelineModule (its layers bare) at each
    (world size, stages) of `loads`: every parameter, fp32 master and Adam moment equals the source's
    (runtime/old.pt, keyed by layer), and the counters come along. `stages`: the source's, one model-states file
    each."""
    from test_export import stock

    out = runtime / f"universal_{name}"
    proc = subprocess.run([sys.executable, "-m", "inmem_ft.cli", "export", *map(str, where), "--format",
                           "deepspeed-universal", "--out", str(out), "--quiet"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported step 4" in proc.stdout
    tag = out / "global_step4"
    assert sorted(n for n in os.listdir(tag) if n.endswith("model_states.pt")) == [
        f"mp_rank_{s:02d}_model_states.pt" for s in range(stages)]
    assert {"tied_modules.embed.weight", "1.pos.weight", "2.qkv.weight", "4.bias"} <= set(os.listdir(tag / "zero"))
    truth = torch.load(runtime / "old.pt", weights_only=True)
    truth.pop("_counters")
    for world, pp in loads:
        got = stock("ds_universal_load.py", ["--load-dir", out, "--zero-stage", 1, "--truth", runtime / "old.pt",
                                             "--pp", pp, "--tied", "embed=0,5"], world,
                    runtime / f"{name}_{world}x{pp}.json")
        assert got["imported_inmem_ft"] is False
        assert got["mismatched"] == [] and got["checked_keys"] == sorted(truth), (world, pp)
        assert got["global_steps"] == 4 and got["optimizer_steps"] == [4.0]


def source_and_export(job, runtime, nodes, per_node, loads, pp=2):
    with SimulatedCluster(nodes, per_node, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run_ok(cluster, example(pp, 1, "fp32", "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        export_and_load(runtime, ["--job", job, "--socket", cluster.socket_path(nodes - 1)], "memory", loads, pp)


def test_pp2_export_loads_in_stock_deepspeed_at_pp1(job, runtime):
    """PP2 x DP1 exported from memory; stock DeepSpeed loads it into one stage."""
    source_and_export(job, runtime, 2, 1, [(1, 1)])


@pytest.mark.slow
def test_pp2_dp2_export_loads_in_stock_deepspeed_at_pp2_dp2_and_pp2_dp1(job, runtime):
    source_and_export(job, runtime, 2, 2, [(4, 2), (2, 2)])


@pytest.mark.slow
def test_pp1_export_loads_in_stock_deepspeed_at_pp2(job, runtime):
    """A PipelineModule in one stage: its snapshot is keyed by layer too, and exports as a pipeline's."""
    source_and_export(job, runtime, 1, 1, [(2, 2)], pp=1)


SCREEN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    from inmem_ft.errors import RestoredStateBad
    from inmem_ft.examples.deepspeed_gpt import ds_config
    from inmem_ft.examples.deepspeed_pipe import Batches, pipeline
    from inmem_ft.examples.ds_common import start
    from inmem_ft.integrations.deepspeed import install

    deepspeed = start()

    def engine():
        torch.manual_seed(0)
        config = ds_config(1, "fp32", 2, 4, 2)
        config["inmem_ft"].update(job=sys.argv[2], sentinel_steps=5)
        model = pipeline(1, 32, 4, 0.0, 1)
        return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)[0]

    data = Batches(1, 0)
    first = engine()
    handle = install(first)
    for _ in range(4):  # snapshots at 2 and 4; the one of step 4 records the 4 losses before it
        first.train_batch(data)
    handle.close()
    second = engine()
    handle = install(second)
    out = {"step": handle.restored.step, "screening": handle.snap.screening}
    second.train_batch(data)  # a healthy step: under the bound
    with torch.no_grad():
        next(second.module.parameters()).fill_(float("nan"))  # what a restored state gone bad would train on
    try:
        second.train_batch(data)
    except RestoredStateBad as e:
        out["tripped"] = str(e)
    handle.close()
    print("RESULT " + json.dumps(out))
    from inmem_ft.teardown import run_main
    run_main(lambda: None)  # the gloo groups go before the interpreter finalizes (teardown.py)
""")


def test_train_batch_losses_reach_the_check_after_a_restore(job, smp):
    """One process, one stage: the restored pipeline engine's train_batch() loss is screened like engine.step()'s
    (a NaN two steps after the restore trips the check and marks the restored step bad)."""
    proc = subprocess.run([sys.executable, "-c", SCREEN_SCRIPT, str(free_port()), job], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["step"] == 4 and out["screening"], out
    assert "step 6 after the restore from step 4: loss nan: step 4 is marked bad" in out.get("tripped", ""), out
