"""Issue 37: lightning.Trainer with InmemFTStrategy (DeepSpeed ZeRO-2, 2 ranks, CPU, gloo, a tiny GPT-2 from a
config): kill -9 one rank mid-epoch, restart, and every later step's loss, learning rate and grad norm equal an
uninterrupted run's (Lightning's loops, its step-wise scheduler, the data position in a shuffled epoch, RNG)."""
import pytest

from test_huggingface import cluster, steps  # noqa: F401  (the fixture: one node, 2 ranks)

pytest.importorskip("lightning")


def test_lightning_zero2_kill_one_rank_resumes_bit_identical(cluster, runtime):  # noqa: F811
    def run(out, *extra):
        return cluster.run(["-m", "inmem_ft.examples.lightning_gpt", "--out", str(out), *map(str, extra)])

    attempt = run(runtime / "ref.jsonl", "--no-inmem")
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    attempt = run(runtime / "killed.jsonl", "--die-at", 10, "--die-rank", 1)
    assert not attempt.ok and attempt.returncodes[1] == -9, cluster.rank_log(attempt.number, 0)[-4000:]
    attempt = run(runtime / "resumed.jsonl")
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    assert "step=8 source=memory" in cluster.rank_log(attempt.number, 1)
    got, want = steps(runtime / "resumed.jsonl"), steps(runtime / "ref.jsonl")
    assert min(got) == 9 and got == {s: v for s, v in want.items() if s >= 9}


@pytest.mark.slow
def test_lightning_restart_after_the_end_stops_at_once(cluster, runtime):  # noqa: F811
    def run(out):
        return cluster.run(["-m", "inmem_ft.examples.lightning_gpt", "--out", str(out), "--steps", "6"])

    assert run(runtime / "first.jsonl").ok
    attempt = run(runtime / "again.jsonl")
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    assert "step=6 source=memory" in cluster.rank_log(attempt.number, 0)
    assert not (runtime / "again.jsonl").exists() or not steps(runtime / "again.jsonl")


@pytest.mark.slow
def test_lightning_restore_past_the_first_epoch(cluster, runtime):  # noqa: F811
    # 16 batches an epoch (64 samples, 2 ranks x 2): the restored step 20 is batch 4 of epoch 1
    def run(out, *extra):
        return cluster.run(["-m", "inmem_ft.examples.lightning_gpt", "--out", str(out), "--steps", "24",
                            *map(str, extra)])

    assert run(runtime / "ref.jsonl", "--no-inmem").ok
    attempt = run(runtime / "killed.jsonl", "--die-at", 22, "--die-rank", 1)
    assert not attempt.ok and attempt.returncodes[1] == -9
    attempt = run(runtime / "resumed.jsonl")
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    assert "step=20 source=memory" in cluster.rank_log(attempt.number, 1)
    got, want = steps(runtime / "resumed.jsonl"), steps(runtime / "ref.jsonl")
    assert min(got) == 21 and got == {s: v for s, v in want.items() if s >= 21}
