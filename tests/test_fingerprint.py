"""Issue 40, part 2: every K-th snapshot the data-parallel replicas compare fingerprints of the replicated bytes
they hold (capture/fingerprint.py). A rank whose weights had a bit flipped is named, its node too, with the
tensor; the step is marked bad on every SMP and never restored; fingerprints on or off train the same losses. A
device tensor's digest is computed with torch ops where it lives (the same function on the host here)."""
import json

import numpy as np
import pytest
import torch

from inmem_ft.capture import fingerprint
from inmem_ft.examples.corrupt import FLIP_AT, FLIP_RANK
from inmem_ft.launcher.simulated import SimulatedCluster
from inmem_ft.smp import control
from inmem_ft.telemetry import read_losses

STEPS, INTERVAL = 9, 3
EXAMPLE = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", str(STEPS), "--interval", str(INTERVAL), "--dp-split"]


def test_shares_cover_the_region_and_the_majority_names_the_suspect():
    # Leaves 0, 2 and 3 replicated (laid at their "ro" offsets, gaps between), leaf 1 the rank's own.
    entries = [{"ro": 0, "n": 40}, {"o": 0, "n": 8}, {"ro": 64, "n": 100}, {"ro": 192, "n": 4}]
    shares = fingerprint.shares(entries, {"total": 256, "dp_size": 3})  # shares of 86 bytes: [0,86) [86,172) ...
    assert [[(p.leaf, p.lo, p.hi, p.at) for p in s] for s in shares] == \
        [[(0, 0, 40, 0), (2, 0, 22, 64)], [(2, 22, 100, 0)], [(3, 0, 4, 20)]]
    assert fingerprint.due(30, 3, 10) and not fingerprint.due(33, 3, 10) and not fingerprint.due(30, 3, 0)
    [d] = fingerprint.compare([[1, 2, 3], [1, 2, 3], [1, 5, 3]])
    assert (d.share, d.groups, d.suspects) == (1, [[0, 1], [2]], [2])
    [d] = fingerprint.compare([[1, 2], [1, 3]])
    assert d.suspects == []  # two replicas: which one is wrong cannot be told
    digests = [np.array([7, 8, 9], dtype=np.uint64), np.array([7, 0, 9], dtype=np.uint64)]
    assert fingerprint.differing(shares[0] + shares[1], digests) == [2]


def _reference_sums(data: np.ndarray) -> list[int]:
    """chunk_sums in plain Python integers: what the torch ops must compute exactly."""
    w = fingerprint.weights(torch.device("cpu")).numpy().astype(object)
    return [int((data[s: s + fingerprint.CHUNK].astype(object) * w[: len(data[s: s + fingerprint.CHUNK])]).sum())
            for s in range(0, len(data), fingerprint.CHUNK)]


def test_the_device_digest_is_exact_position_dependent_and_catches_every_flipped_byte():
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (3 * fingerprint.CHUNK + 1000,), dtype=torch.uint8, generator=g)
    sums = fingerprint.chunk_sums(data)
    assert sums.dtype == torch.int64 and sums.tolist() == _reference_sums(data.numpy())
    assert fingerprint.chunk_sums(data[5:17]).tolist() == _reference_sums(data[5:17].numpy())  # any offset, a tail
    assert fingerprint.chunk_sums(data[:0]).numel() == 0
    for at in (0, 1, fingerprint.CHUNK - 1, 2 * fingerprint.CHUNK + 7, data.numel() - 1):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[at] ^= 1 << bit
            assert not torch.equal(fingerprint.chunk_sums(flipped), sums), (at, bit)
    swapped = data.clone()
    swapped[[10, 11]] = data[[11, 10]]
    assert data[10] != data[11] and not torch.equal(fingerprint.chunk_sums(swapped), sums)


def test_each_piece_is_digested_where_it_lives_and_the_slot_fills_in_the_host_pieces():
    values = [torch.arange(64, dtype=torch.float32), torch.ones(16, dtype=torch.bfloat16)]
    pieces = [fingerprint.Piece(0, 0, 256, 0), fingerprint.Piece(1, 0, 32, 256)]
    slot = torch.cat([v.view(torch.uint8) for v in values]).numpy()
    full = fingerprint.of_state(values, pieces)
    assert not fingerprint.of_state(values, pieces, device_only=True).any()  # no device tensors here
    assert np.array_equal(fingerprint.of_slot(slot, pieces, values, np.zeros(2, dtype=np.uint64)), full)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_piece_digests_on_the_device_as_the_host_would():
    data = torch.randint(0, 256, (5 * fingerprint.CHUNK + 3,), dtype=torch.uint8)
    assert torch.equal(fingerprint.chunk_sums(data.cuda()).cpu(), fingerprint.chunk_sums(data))
    values = [torch.randn(1000).cuda(), torch.randn(10)]
    pieces = [fingerprint.Piece(0, 4, 4000, 0), fingerprint.Piece(1, 0, 40, 3996)]
    own = fingerprint.of_state(values, pieces, device_only=True)
    assert own[0] and not own[1]
    slot = torch.cat([values[0].cpu().view(torch.uint8)[4:], values[1].view(torch.uint8)]).numpy()
    assert np.array_equal(fingerprint.of_slot(slot, pieces, values, own), fingerprint.of_state(values, pieces))


@pytest.fixture
def cluster(job, runtime):
    with SimulatedCluster(nodes=3, ranks_per_node=1, job=job, memory_budget=64 << 20,
                          log_dir=str(runtime / "logs")) as c:
        yield c


def caught(cluster, argv, step: int, rank: int, verdict: str) -> None:
    """A run whose rank `rank` flips a weight bit after step `step` stops there, rank 0's one line saying `verdict`
    of it, and every SMP holds that step bad."""
    first = cluster.run(argv, extra_env={FLIP_AT: str(step), FLIP_RANK: str(rank)})
    assert not first.ok
    out = cluster.rank_log(first.number, 0)
    assert f"event=replica_mismatch reason=step {step}: the data-parallel replicas disagree: {verdict}" in out, out
    assert f"ReplicasDisagree: inmem_ft: step {step}: " in out and "Traceback" not in out
    for node in range(cluster.nodes):
        status = control.call(cluster.socket_path(node), "status")
        assert status["bad_steps"] == [step] and status["counters"]["replica_mismatches"] == 1, status


def test_a_flipped_replica_is_named_and_its_step_never_restored(cluster, runtime):
    """Rank 2 (node 2) flips a bit of its first weight after step 6's optimizer step: step 6's fingerprints name
    it (two replicas against one), every SMP marks 6 bad and the ranks stop; the next run resumes from step 3 and
    trains steps 4-6 bit-identically to the first run (which had not flipped yet)."""
    log = runtime / "loss.jsonl"
    caught(cluster, EXAMPLE + ["--fingerprint-every", "1", "--loss-log", str(log)], 6, 2,
           "the share stored by rank 0 (node 0): rank 2 (node 2) differs from the other 2 replicas (the suspect), in "
           "state.train.model.0.weight")
    before = read_losses(log)
    log.unlink()
    second = cluster.run(EXAMPLE + ["--fingerprint-every", "1", "--loss-log", str(log)])
    assert second.ok, cluster.rank_log(second.number, 0)
    assert "restore rank=0 step=3 source=memory" in cluster.rank_log(second.number, 0)
    after = read_losses(log)
    assert min(after) == 4 and all(after[s] == before[s] for s in (4, 5, 6))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [(), ("--overlap",)], ids=["copy", "overlap"])
def test_fingerprints_on_and_off_train_the_same_losses(cluster, runtime, overlap):
    losses = {}
    for every in ("1", "0"):
        cluster.stop()  # wiped: each run starts from scratch
        cluster.start()
        log = runtime / f"loss{every}.jsonl"
        attempt = cluster.run(EXAMPLE + [*overlap, "--fingerprint-every", every, "--loss-log", str(log)])
        assert attempt.ok, cluster.rank_log(attempt.number, 0)
        out = cluster.rank_log(attempt.number, 0)
        assert (out.count("event=replicas_agree") == STEPS // INTERVAL) == (every == "1"), out
        losses[every] = read_losses(log)
    assert losses["1"] == losses["0"] and sorted(losses["1"]) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_deepspeed_zero2_replicas_that_disagree_are_caught_and_the_step_never_restored(job, runtime):
    """ZeRO-2 on 2 nodes: rank 1 flips a bit of a module weight after step 4's update, before its snapshot. Two
    replicas cannot tell which is wrong: both are named; step 4 is bad on both SMPs and the next run resumes
    from step 2."""
    from inmem_ft.examples.deepspeed_gpt import ds_config

    config = ds_config(2, "fp32", 2)
    config["inmem_ft"]["fingerprint_every"] = 1
    path = runtime / "ds.json"
    path.write_text(json.dumps(config))
    example = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", "6", "--interval", "2",
               "--config", str(path)]
    with SimulatedCluster(2, 1, job, 256 << 20, str(runtime / "logs"), env={"DS_ACCELERATOR": "cpu"}) as c:
        caught(c, example, 4, 1, "the share stored by rank 0 (node 0): [rank 0 (node 0)] against [rank 1 (node 1)] "
                                 "(no majority: which is wrong cannot be told), in state.files.mp_rank_00_model_states"
                                 ".pt.module.")
        second = c.run(example)
        assert second.ok, c.rank_log(second.number, second.first_failure or 0)
        assert "restore rank=0 step=2 source=memory" in c.rank_log(second.number, 0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_bf16_replicas_agree_on_every_snapshot_of_a_healthy_run(job, runtime, stage):
    """bf16 ZeRO-0/1 on 2 nodes, every snapshot compared: no false positive (the replicas' bf16 weights, fp32
    masters and moments are the same bytes on both), and the run trains to the end."""
    from inmem_ft.examples.deepspeed_gpt import ds_config

    config = ds_config(stage, "bf16", 2)
    config["inmem_ft"]["fingerprint_every"] = 1
    path = runtime / "ds.json"
    path.write_text(json.dumps(config))
    example = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", str(stage), "--dtype", "bf16", "--steps",
               "8", "--interval", "2", "--config", str(path)]
    with SimulatedCluster(2, 1, job, 256 << 20, str(runtime / "logs"), env={"DS_ACCELERATOR": "cpu"}) as c:
        attempt = c.run(example)
        assert attempt.ok, c.rank_log(attempt.number, attempt.first_failure or 0)
        for rank in (0, 1):
            out = c.rank_log(attempt.number, rank)
            assert out.count("event=replicas_agree") == 4 and "replica_mismatch" not in out, out[-3000:]
