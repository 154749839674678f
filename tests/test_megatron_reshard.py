"""Issue 10, item 2 (Megatron): a Megatron-Core job back on another TP/PP/DP layout resumes from the old
layout's snapshots in memory. megatron-core's own pretrain() on CPU (gloo, tests/megatron_cpu_shim.py),
the distributed optimizer, real SMPs. Each rank dumps its model-space pieces at iteration STEP (the source
right after training it, the new layout right after loading it): the global tensors assembled from them,
every parameter, fp32 master and Adam moment, are bit-identical; the iteration, consumed samples, scheduler
and Adam steps match; the next iteration's loss equals the source layout's within LOSS_RTOL (the same global
batch, summed in another order over other ranks; dropout is off, since the RNG streams of ranks that did not
exist cannot match).

A Megatron launch costs about 10-25 s here, mostly imports: the default case is TP1 -> TP2 (1 + 2 processes);
the 4-rank, PP and `reshard: never` cases are `slow`.
"""
import contextlib
import importlib.util
import json
import math
import os
import uuid

import pytest
import torch

from conftest import ROOT
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp.segments import names_with_prefix, unlink
from inmem_ft.telemetry import read_losses

if importlib.util.find_spec("megatron") is None:  # not importorskip: importing it needs the shim first
    pytest.skip("megatron-core is not installed (scripts/bootstrap.sh installs it)", allow_module_level=True)

STEP, ITERS = 3, 4  # the snapshot resharded, the last iteration trained
LOSS_RTOL = 1e-5
# Layout-independent shapes and batches: one sample per micro-batch (gbs 4 fits DP 1..4), the padded
# vocabulary the same at TP 1 and 2 (128: megatron-core 0.17's NullTokenizer adds an end-of-document token to
# --vocab-size, 0.18's and 0.19's count it in), no dropout.
COMMON = ["--use-distributed-optimizer", "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout",
          "0", "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--train-iters", str(ITERS),
          "--inmem-ft", "--inmem-ft-interval", str(STEP)]


@contextlib.contextmanager
def source_job(tmp, tp, pp, dp=1):
    """A job on TP x PP x DP (one node) that trained ITERS iterations; the snapshot of STEP stays in its SMP."""
    job = f"t{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INMEM_FT_RUNTIME_DIR", str(tmp / "run"))
        mp.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            with SimulatedCluster(1, tp * pp * dp, job, 256 << 20, str(tmp / "logs")) as cluster:
                cluster.tmp = tmp
                cluster.source = run(cluster, "source", tp, pp)
                yield cluster
        finally:
            for seg in names_with_prefix(f"inmemft.{job}."):
                unlink(seg)


def run(cluster, name: str, tp: int, pp: int, *extra, ok=True) -> dict:
    dump, losses = cluster.tmp / name, cluster.tmp / f"{name}.jsonl"
    attempt = cluster.run(["-m", "inmem_ft.examples.megatron_gpt", *COMMON, "--tensor-model-parallel-size", str(tp),
                           "--pipeline-model-parallel-size", str(pp), "--loss-log", str(losses),
                           "--dump-state", str(dump), "--dump-at", str(STEP), *extra])
    log = cluster.rank_log(attempt.number, 0)
    if not ok:
        assert not attempt.ok
        return {"log": log}
    assert attempt.ok, cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:]
    dumps = [torch.load(f"{dump}.rank{r}.pt", weights_only=True) for r in range(cluster.world_size)]
    counters = [d["counters"] for d in dumps]
    assert all(c == counters[0] for c in counters), counters
    return {"global": assemble(dumps), "counters": counters[0], "losses": read_losses(str(losses)), "log": log}


def assemble(dumps: list[dict]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's pieces; replicas must agree, and every element must be covered."""
    out, seen = {}, {}
    for d in dumps:
        for p in d["pieces"]:
            full = out.setdefault(p["key"], torch.full(p["shape"], float("nan"), dtype=p["data"].dtype))
            covered = seen.setdefault(p["key"], torch.zeros(p["shape"], dtype=torch.bool))
            box = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["box"]))
            region, mark = full[box].reshape(-1).clone(), covered[box].reshape(-1).clone()
            lo, hi = p.get("flat", (0, region.numel()))
            data = p["data"].reshape(-1)
            if mark[lo:hi].any():
                assert torch.equal(region[lo:hi][mark[lo:hi]], data[mark[lo:hi]]), f"{p['key']}: replicas differ"
            region[lo:hi], mark[lo:hi] = data, True
            full[box], covered[box] = region.view(full[box].shape), mark.view(covered[box].shape)
    holes = [k for k, c in seen.items() if not c.all()]
    assert holes == [], holes
    return out


def reshard(cluster, tp: int, pp: int, dp: int, old: str) -> dict:
    cluster.reshape(1, tp * pp * dp)
    got = run(cluster, f"tp{tp}pp{pp}dp{dp}", tp, pp)
    source = cluster.source
    assert f"restore rank=0 step={STEP} source=memory_resharded from={old} to=tp{tp}.pp{pp}.dp{dp} seconds=" \
           in got["log"]
    truth, new = source["global"], got["global"]
    assert sorted(new) == sorted(truth) and any(k.startswith("optimizer.state.exp_avg_sq.") for k in truth)
    assert [k for k in truth if not torch.equal(new[k], truth[k])] == []  # bit-identical
    assert got["counters"] == source["counters"]  # iteration, consumed samples, scheduler, Adam steps
    assert math.isclose(got["losses"][ITERS], source["losses"][ITERS], rel_tol=LOSS_RTOL), \
        (got["losses"], source["losses"])
    assert sorted(got["losses"]) == [ITERS]  # resumed at STEP, not from scratch
    return got


@pytest.mark.compat
def test_tp1_resumes_as_tp2_bit_identical(tmp_path):
    with source_job(tmp_path, 1, 1) as cluster:
        reshard(cluster, 2, 1, 1, "tp1.pp1.dp1")


@pytest.mark.slow
def test_tp2_pp2_resumes_as_dp4(tmp_path):
    with source_job(tmp_path, 2, 2) as cluster:
        reshard(cluster, 1, 1, 4, "tp2.pp2.dp1")


@pytest.mark.slow
def test_pp2_resumes_as_pp1_and_never_keeps_the_clear_error(tmp_path):
    with source_job(tmp_path, 1, 2) as cluster:
        config = tmp_path / "never.json"
        config.write_text(json.dumps({"inmem_ft": {"reshard": "never"}}))
        cluster.reshape(1, 1)
        never = run(cluster, "never", 1, 1, "--inmem-ft-config", str(config), ok=False)
        assert "LayoutChanged: the newest snapshots in memory (step 3, found by rank 0) were taken with world " \
               "size 2 (tp1.pp2.dp1), this job runs with world size 1 (tp1.pp1.dp1)" in never["log"]
        reshard(cluster, 1, 1, 1, "tp1.pp2.dp1")
