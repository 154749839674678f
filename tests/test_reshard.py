"""Issue 10, items 1-2 (DeepSpeed): a job back on another DP size or ZeRO stage resumes from the old layout's
snapshots in memory. Real DeepSpeed engines (CPU, gloo) and SMP processes: after the reshard every parameter,
fp32 master and Adam moment is bit-identical to the source's global tensor (both gathered by DeepSpeed), the
step, scheduler and data position match, and the next two losses equal the source layout's within an fp32
tolerance (every layout trains on the same global batches, `--global-batch`; the reduction order differs).
One case reads a lost node's fragments from parity; `reshard: never` keeps the clear error."""
import contextlib
import json
import math
import os
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT, wait_for_log, wait_protected
from inmem_ft.config import InmemFTBlock
from inmem_ft.errors import CatalogHole, ConfigError, StepIncomplete
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
from inmem_ft.smp.segments import names_with_prefix, unlink
from inmem_ft.snapshot import catalog, layout
from inmem_ft.snapshot.shardspec import ShardSpec
from inmem_ft.snapshot.topology import Topology
from inmem_ft.snapshot.tree import Replicated, Sharded, flatten
from inmem_ft.telemetry import read_losses
from inmem_ft.universal.assemble import Fragments
from inmem_ft.universal.reshard import per_rank_source

ENV = {"DS_ACCELERATOR": "cpu"}
STEP, STEPS = 4, 6  # the snapshot resharded, the last step trained (two steps after it)
LOSS_RTOL = 1e-5  # fp32: the same global batch, summed in another order over another number of ranks


# ---- pieces, the per-rank rule, steps of two layouts: no processes --------------------------------------

def test_pieces_read_only_the_bytes_that_overlap_them():
    """Fragments of every shape a snapshot holds (a box split across two data-parallel shares, flat ZeRO
    ranges, whole copies with one main): any box or flat range of a global tensor comes back exact, and only
    bytes overlapping it are read."""
    g = torch.Generator().manual_seed(0)
    truth = {"w": torch.randn(6, 10, generator=g), "m": torch.randn(7, 9, generator=g),
             "e": torch.randn(3, 4, generator=g).to(torch.bfloat16)}
    world, slots, entries = 4, {}, []
    for rank in range(world):
        tp, dp = rank % 2, rank // 2
        flat = truth["m"].reshape(-1)
        lo, hi = min(63, 16 * rank), min(63, 16 * rank + 16)
        state = {"rep": Replicated({"w": Sharded(truth["w"][:, 5 * tp: 5 * tp + 5].contiguous(),
                                                 ShardSpec("w", (6, 10), (0, 5 * tp), (6, 5)))}),
                 "m": Sharded(flat[lo:hi].clone(), ShardSpec("m", (7, 9), flat=(lo, hi))),
                 "e": Sharded(truth["e"].clone(), ShardSpec("e", (3, 4), main=rank == 3, replica=(rank,)))}
        flat_state = flatten(state)
        topo = Topology(world_size=world, tp=2, dp=2, coords={"tp": tp, "dp": dp})
        plan = layout.plan(flat_state, step=STEP, rank=rank, world_size=world, dp_rank=dp, dp_size=2,
                           topology=topo)
        data = np.zeros(plan.data_len, dtype=np.uint8)
        for c in plan.copies:
            raw = flat_state.leaves[c.leaf].value.contiguous().reshape(-1).view(torch.uint8).numpy()
            data[c.dst: c.dst + c.hi - c.lo] = raw[c.lo: c.hi]
        slots[rank] = data
        entries.append({"node": rank // 2, "rank": rank, "step": STEP, "segment": None, "data_off": 0,
                        "data_len": plan.data_len, "source": "memory", "manifest": plan.manifest})
    reads = []

    def read(node, rank, step, offset, length, into=None):
        reads.append(length)
        out = slots[rank][offset: offset + length].copy()
        if into is not None:
            into[:] = out
        return out

    table = catalog.fragments(entries, STEP)
    catalog.check(table)
    frags = Fragments(table)
    for key, t in truth.items():
        assert torch.equal(frags.tensor(key, read), t), key
    for key, offset, shape, flat in [("w", (1, 3), (4, 6), None), ("w", (0, 0), (6, 10), (17, 44)),
                                     ("m", None, None, (15, 33)), ("m", (2, 1), (3, 8), (5, 20)),
                                     ("e", (1, 1), (2, 3), None)]:
        reads.clear()
        box = truth[key][tuple(slice(o, o + s) for o, s in zip(offset or (0, 0), shape or truth[key].shape))]
        want = box.reshape(-1)[slice(*flat) if flat else slice(None)]
        got = frags.piece(key, read, offset, shape, flat)
        assert torch.equal(got, want), (key, offset, shape, flat)
        assert sum(reads) < truth[key].numel() * truth[key].element_size(), "read more than the piece needs"
        # A device target (Megatron's CUDA parameter): meta stands in, whose .numpy(), .cpu() and data reads
        # raise, so the bytes must go through host memory and one copy into it.
        meta = torch.empty(want.numel(), dtype=want.dtype, device="meta")
        assert frags.piece(key, read, offset, shape, flat, out=meta) is meta
    frags.by_key["m"].pop()  # a fragment gone: said, not assembled wrong
    with pytest.raises(CatalogHole, match="'m'"):
        frags.piece("m", read, flat=(50, 63))


def test_per_rank_state_comes_from_the_same_coordinates_else_modulo_the_old_size():
    old = {r: {"coords": {"dp": r, "tp": 0, "pp": 0}, "dp": 2, "world_size": 2} for r in range(2)}
    src = SimpleNamespace(manifests=old, topology=old[0], topology_of=lambda r: old[r])
    picks = [per_rank_source(src, Topology(world_size=4, dp=4, coords={"dp": d, "tp": 0, "pp": 0}))
             for d in range(4)]
    assert picks == [0, 1, 0, 1]


def test_each_step_is_judged_against_its_own_world_size():
    """After a reshard the SMPs hold steps of both layouts until the old ones are overwritten."""
    def entry(rank, step, world):
        return {"rank": rank, "step": step, "manifest": {"world_size": world}}

    entries = [entry(r, 4, 2) for r in range(2)] + [entry(r, 6, 4) for r in range(3)]
    assert catalog.complete_step(entries) == 4  # step 6 lacks rank 3 of 4
    assert catalog.complete_step(entries + [entry(3, 6, 4)]) == 6
    with pytest.raises(StepIncomplete, match=r"ranks \[3\]"):
        catalog.complete_step(entries, 6)
    with pytest.raises(StepIncomplete, match="disagree on the world size"):
        catalog.complete_step(entries + [entry(2, 4, 4)])


def test_reshard_setting_is_checked():
    assert InmemFTBlock.from_dict({}).reshard == "auto"
    assert InmemFTBlock.from_dict({"reshard": "never"}).reshard == "never"
    with pytest.raises(ConfigError, match=r"'reshard' = 'sometimes': must be one of \('auto', 'never'\)"):
        InmemFTBlock.from_dict({"reshard": "sometimes"})


# ---- real DeepSpeed jobs ------------------------------------------------------------------------------

@contextlib.contextmanager
def source_job(tmp, nodes, per_node, stage, dtype="fp32", parity=None, *extra, smp_args=()):
    """A job of nodes x per_node ranks at ZeRO `stage` that trained STEPS steps; the snapshot of STEP stays in
    its SMPs. Yields the cluster, with what the job measured as `cluster.source`."""
    job = f"t{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INMEM_FT_RUNTIME_DIR", str(tmp / "run"))
        mp.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            with SimulatedCluster(nodes, per_node, job, 256 << 20, str(tmp / "logs"), env=ENV,
                                  parity=parity, smp_args=smp_args) as cluster:
                cluster.tmp, cluster.dtype = tmp, dtype
                cluster.source = run(cluster, "source", stage, *extra)
                yield cluster
        finally:
            for seg in names_with_prefix(f"inmemft.{job}."):
                unlink(seg)


def run(cluster, name, stage, *extra, ok=True) -> dict:
    """The example on the cluster's current shape: the global tensors right after step STEP (or its restore)
    as DeepSpeed gathers them, the counters, the losses of the steps it trained, rank 0's log."""
    dump, losses = cluster.tmp / f"{name}.pt", cluster.tmp / f"{name}.jsonl"
    attempt = cluster.run([str(a) for a in [
        "-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", stage, "--dtype", cluster.dtype, "--steps", STEPS,
        "--interval", STEP, "--global-batch", 8, "--dropout", 0, "--loss-log", losses,
        "--dump-full", dump, "--dump-step", STEP, "--dump-weights", *extra]])
    log = cluster.rank_log(attempt.number, 0)
    if not ok:
        assert not attempt.ok
        return {"log": log}
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    with open(f"{dump}.json") as f:
        counters = json.load(f)
    return {"full": torch.load(dump, weights_only=True), "counters": counters, "losses": read_losses(losses),
            "log": log}


def reshard(cluster, nodes, per_node, stage, old, new, tier="memory_resharded", *extra) -> dict:
    """Back on nodes x per_node ranks at ZeRO `stage`: resumed exactly as the source job went on."""
    cluster.reshape(nodes, per_node)
    got = run(cluster, f"z{stage}n{nodes}x{per_node}", stage, *extra)
    source = cluster.source
    assert f"restore rank=0 step={STEP} source={tier} from={old} to={new} seconds=" in got["log"]
    truth, full = source["full"], got["full"]
    assert sorted(full) == sorted(truth)
    assert [k for k in truth if not torch.equal(full[k], truth[k])] == []  # bit-identical, weights included
    assert got["counters"] == {**source["counters"], "restored": tier}  # steps, lr, scheduler, data position
    # fp32: the same global batches summed in another order; bf16 rounds each partial sum to 8 bits.
    rtol = LOSS_RTOL if cluster.dtype == "fp32" else 1e-3
    for step in range(STEP + 1, STEPS + 1):
        assert math.isclose(got["losses"][step], source["losses"][step], rel_tol=rtol), (step, got["losses"])
    return got


@pytest.fixture(scope="module")
def zero1_dp2(tmp_path_factory):
    """ZeRO-1 fp32 on 2 nodes x 1 rank, shared by the tests of this module."""
    with source_job(tmp_path_factory.mktemp("zero1_dp2"), 2, 1, 1) as cluster:
        yield cluster


def test_reshard_never_keeps_the_clear_error(zero1_dp2):
    cluster = zero1_dp2
    cluster.reshape(1, 1)
    got = run(cluster, "never", 3, "--reshard", "never", ok=False)
    assert "LayoutChanged: the newest snapshots in memory (step 4, found by rank 0) were taken with world size 2 " \
           "(tp1.pp1.dp2.zero1), this job runs with world size 1 (tp1.pp1.dp1.zero3): restart with the original " \
           "layout, or let inmem_ft reshard them" in got["log"]
    assert control.call(cluster.socket_path(0), "list", rank=0)["slots"][0]["step"] == STEP  # nothing discarded


@pytest.mark.compat
def test_zero1_dp2_resumes_as_zero3_dp1_bit_identical(zero1_dp2):
    """DP 2 -> 1 and ZeRO-1 -> 3 at once; node 1's fragments come over the SMPs' peer link."""
    got = reshard(zero1_dp2, 1, 1, 3, "tp1.pp1.dp2.zero1", "tp1.pp1.dp1.zero3")
    assert "bytes_memory=" in got["log"] and "bytes_parity=" not in got["log"]


@pytest.mark.slow
@pytest.mark.parametrize("nodes,per_node,stage,new", [(2, 2, 1, "tp1.pp1.dp4.zero1"), (2, 1, 2, "tp1.pp1.dp2.zero2")])
def test_zero1_dp2_resumes_on_dp4_and_on_zero2(zero1_dp2, nodes, per_node, stage, new):
    reshard(zero1_dp2, nodes, per_node, stage, "tp1.pp1.dp2.zero1", new)


@pytest.mark.slow
def test_zero3_bf16_dp1_resumes_as_zero2_dp2_and_zero1_dp1(tmp_path):
    with source_job(tmp_path, 1, 1, 3, "bf16") as cluster:
        reshard(cluster, 1, 2, 2, "tp1.pp1.dp1.zero3", "tp1.pp1.dp2.zero2")
        reshard(cluster, 1, 1, 1, "tp1.pp1.dp1.zero3", "tp1.pp1.dp1.zero1")


@pytest.mark.slow
def test_zero2_dp2_resumes_as_zero3_then_as_zero1_dp1_from_parity_after_losing_a_node(tmp_path):
    with source_job(tmp_path, 2, 1, 2, parity=1) as cluster:
        reshard(cluster, 2, 1, 3, "tp1.pp1.dp2.zero2", "tp1.pp1.dp2.zero3")
        wait_protected(cluster, STEP)
        cluster.kill_smp(1)
        cluster.wipe_node(1)
        got = reshard(cluster, 1, 1, 1, "tp1.pp1.dp2.zero2", "tp1.pp1.dp1.zero1")
        assert "bytes_parity=" in got["log"]


@pytest.mark.slow
def test_zero2_dp2_resumes_as_zero1_dp1_from_the_disk_tier_when_memory_is_gone(tmp_path):
    """The SMPs flushed step 4; memory is wiped; the new SMPs adopt it from disk and the job reshards from it."""
    smp_args = ["--persist-dir", tmp_path / "ckpt", "--persist-every-steps", STEP]
    with source_job(tmp_path, 2, 1, 2, "fp32", None, smp_args=smp_args) as cluster:
        for node in range(cluster.nodes):
            wait_for_log(cluster.smp_log(node), f"event=flushed step={STEP} ")
            cluster.kill_smp(node)
            cluster.wipe_node(node)
            cluster.start_smp(node)
            assert f"step={STEP} from=disk" in open(cluster.smp_log(node)).read()
        reshard(cluster, 1, 1, 1, "tp1.pp1.dp2.zero2", "tp1.pp1.dp1.zero1")
