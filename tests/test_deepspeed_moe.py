"""Issue 30, items 3-4: DeepSpeed mixture of experts (deepspeed.moe.layer.MoE) with expert parallelism, ZeRO-1/2,
protected by inmem_ft on CPU/gloo with real SMPs: 4 experts per layer over EP2 on 4 ranks (two expert-data-
parallel replicas of each expert). kill -9 a rank, restart, resume from memory with the losses of the
uninterrupted run bit for bit; the shard map keys experts by their global id; a snapshot of EP2 reshards to EP1
with every parameter, fp32 master and Adam moment equal to the source's global tensors."""
import os

import pytest
import torch

from conftest import wait_for_log
from inmem_ft.cli import main
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.client import SMPClient
from inmem_ft.snapshot import catalog
from inmem_ft.telemetry import read_losses
from inmem_ft.universal.assemble import keys

STEPS, INTERVAL, EXPERTS = 8, 2, 4
ENV = {"DS_ACCELERATOR": "cpu"}
EXPERT = "blocks.{}.mlp.deepspeed_moe.experts.deepspeed_experts.{}.{}"
DENSE = {f"blocks.{b}.{n}" for b in (0, 1) for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "qkv.weight",
                                                        "qkv.bias", "proj.weight", "proj.bias",
                                                        "mlp.deepspeed_moe.gate.wg.weight")} | \
    {"tok.weight", "pos.weight", "ln.weight", "ln.bias", "head.weight"}
EXPERTS_KEYS = {EXPERT.format(b, e, n) for b in (0, 1) for e in range(EXPERTS)
                for n in ("0.weight", "0.bias", "2.weight", "2.bias")}


def example(ep, stage, *extra, steps=STEPS, dtype="fp32"):
    return [str(a) for a in ["-m", "inmem_ft.examples.deepspeed_moe", "--ep", ep, "--experts", EXPERTS,
                             "--zero-stage", stage, "--dtype", dtype, "--steps", steps, "--interval", INTERVAL,
                             *extra]]


def run_ok(cluster, argv):
    attempt = cluster.run(argv)
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    return attempt


def shard_keys(cluster, step):
    """The global keys of the job's snapshot of `step`, after checking every one is covered exactly once by
    main fragments."""
    client = SMPClient(cluster.socket_path(0))
    try:
        table = catalog.fragments(client.catalog()["entries"], step)
        catalog.check(table)
        return {k for k in keys(table) if not k.startswith("_")}
    finally:
        client.close()


@pytest.mark.slow  # three runs of four ranks: about 3 minutes on two cores
@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "bf16")])
def test_moe_ep2_kill_and_resume_bit_identical_and_keys_by_global_expert(job, runtime, stage, dtype):
    """EP2 x (expert) DP2 on two nodes of two ranks; rank 3 (node 1, EP rank 1: experts 2 and 3) is killed after
    step 7 (snapshots at 2, 4, 6); the restart resumes at step 7 from memory and repeats the uninterrupted
    run's losses bit for bit. Each expert's optimizer state is keyed by its global id, covered once. The
    explicit save_checkpoint at the end writes DeepSpeed's own MoE checkpoint (a file per expert)."""
    ref, before, resumed = runtime / "ref.jsonl", runtime / "before.jsonl", runtime / "resumed.jsonl"
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run_ok(cluster, example(2, stage, "--loss-log", ref, "--no-inmem", dtype=dtype))
        attempt = cluster.run(example(2, stage, "--loss-log", before, "--die-at", 7, "--die-rank", 3, dtype=dtype))
        assert not attempt.ok and attempt.returncodes[3] == -9
        attempt = run_ok(cluster, example(2, stage, "--loss-log", resumed, "--save-dir", runtime / "stock",
                                          dtype=dtype))
        for rank in range(cluster.world_size):
            assert "step=6 source=memory" in cluster.rank_log(attempt.number, rank)
        got = shard_keys(cluster, STEPS)
    ref = read_losses(ref)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert read_losses(before) == {s: ref[s] for s in range(1, 8)}
    assert read_losses(resumed) == {s: ref[s] for s in range(7, STEPS + 1)}  # bit-identical
    saved = set(os.listdir(runtime / "stock" / f"global_step{STEPS}"))  # the user's save: DeepSpeed's own files
    zero = "bf16_zero" if dtype == "bf16" else "zero"
    assert {f"layer_{b}_expert_{e}_mp_rank_00_model_states.pt" for b in (0, 1) for e in range(EXPERTS)} | \
        {"mp_rank_00_model_states.pt"} | {f"{zero}_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)} <= saved
    weights = DENSE | EXPERTS_KEYS
    optimizer = {f"optimizer.state.{kind}.{k}" for kind in ("fp32_param", "exp_avg", "exp_avg_sq") for k in weights}
    assert got == DENSE | optimizer  # expert weights are their fp32 masters


def reshard_and_compare(cluster, tmp, old_ep, new_ep, stage=1, new_stage=1, tier="memory_resharded"):
    """The example at (old_ep, stage) dumped after step 4 (the snapshot) is already in `tmp`/old.pt; the
    restart at (new_ep, new_stage) reads its share of every parameter by its key: every global parameter,
    master, moment and counter equals the old layout's bit for bit."""
    world = cluster.world_size
    attempt = run_ok(cluster, example(new_ep, new_stage, "--dump-full", tmp / "new.pt", "--dump-step", 4, steps=4))
    assert (f"step=4 source={tier} from=tp1.pp1.dp4.ep{old_ep}.zero{stage} "
            f"to=tp1.pp1.dp{world}{f'.ep{new_ep}' if new_ep > 1 else ''}.zero{new_stage}") \
        in cluster.rank_log(attempt.number, 0)
    old, new = torch.load(tmp / "old.pt", weights_only=True), torch.load(tmp / "new.pt", weights_only=True)
    counters = old.pop("_counters"), new.pop("_counters")
    assert {**counters[0], "restored": tier} == counters[1]
    assert set(old) == set(new) and len(old) == 4 * len(DENSE | EXPERTS_KEYS)
    assert [k for k, want in old.items() if not torch.equal(new[k], want)] == []


def test_reshard_ep2_to_ep1_bit_identical(job, runtime, capsys):
    """EP2 on 4 ranks -> EP1 on 2 ranks (each rank now holds all 4 experts of every layer; DP 4 -> 2). Stock
    DeepSpeed's universal checkpoint has no place for these experts: export says so and writes nothing; a
    torch-dcp export holds every key of the snapshot."""
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV) as cluster:
        run_ok(cluster, example(2, 1, "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        cluster.reshape(2, 1)
        reshard_and_compare(cluster, runtime, 2, 1)
        assert main(["export", "--job", job, "--socket", cluster.socket_path(0), "--format", "deepspeed-universal",
                     "--out", str(runtime / "universal"), "--quiet"]) == 1
        assert main(["export", "--job", job, "--socket", cluster.socket_path(0), "--format", "torch-dcp",
                     "--out", str(runtime / "dcp"), "--quiet"]) == 0
    assert "--format deepspeed-universal cannot represent step 4's mixture-of-experts layers" in \
        capsys.readouterr().err
    assert not (runtime / "universal" / "latest_universal").exists()
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(str(runtime / "dcp")).read_metadata()
    old = torch.load(runtime / "old.pt", weights_only=True)
    assert {k for k in old if k.startswith("optimizer.")} <= set(metadata.state_dict_metadata)


@pytest.mark.slow
def test_reshard_ep2_to_ep1_from_the_disk_tier_bit_identical(job, runtime):
    """The SMPs flushed step 4 of EP2 ZeRO-2 and lost their memory; the new SMPs adopt it from disk and a job of
    EP1 ZeRO-1 on the same 4 ranks reshards from it."""
    smp_args = ["--persist-dir", runtime / "ckpt", "--persist-every-steps", 4]
    with SimulatedCluster(2, 2, job, 256 << 20, str(runtime / "logs"), env=ENV, smp_args=smp_args) as cluster:
        run_ok(cluster, example(2, 2, "--dump-full", runtime / "old.pt", "--dump-step", 4, steps=4))
        for node in range(cluster.nodes):
            wait_for_log(cluster.smp_log(node), "event=flushed step=4 ")
            cluster.kill_smp(node)
            cluster.wipe_node(node)
            cluster.start_smp(node)
            assert "step=4 from=disk" in open(cluster.smp_log(node)).read()
        reshard_and_compare(cluster, runtime, 2, 1, stage=2, new_stage=1)

