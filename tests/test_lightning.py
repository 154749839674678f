"""Issue 37: lightning.Trainer with InmemFTStrategy (DeepSpeed ZeRO-2, 2 ranks, CPU, gloo, a tiny GPT-2 from a
config): kill -9 one rank mid-epoch, restart, and every later step's loss, learning rate and grad norm equal an
uninterrupted run's (Lightning's loops, its step-wise scheduler, the data position in a shuffled epoch, RNG)."""
import pytest

from test_huggingface import cluster, resume_after_kill, run_example, steps  # noqa: F401  (cluster: a fixture)

pytest.importorskip("lightning")


def test_lightning_zero2_kill_one_rank_resumes_bit_identical(cluster, runtime):  # noqa: F811
    resume_after_kill(cluster, runtime, "lightning_gpt", 10, 9)


@pytest.mark.slow
def test_lightning_restart_after_the_end_stops_at_once(cluster, runtime):  # noqa: F811
    assert run_example(cluster, "lightning_gpt", runtime / "first.jsonl", "--steps", 6).ok
    attempt = run_example(cluster, "lightning_gpt", runtime / "again.jsonl", "--steps", 6)
    assert attempt.ok, cluster.rank_log(attempt.number, 0)[-4000:]
    assert "step=6 source=memory" in cluster.rank_log(attempt.number, 0)
    assert not (runtime / "again.jsonl").exists() or not steps(runtime / "again.jsonl")


@pytest.mark.slow
def test_lightning_restore_past_the_first_epoch(cluster, runtime):  # noqa: F811
    # 16 batches an epoch (64 samples, 2 ranks x 2): the restored step 20 is batch 4 of epoch 1
    resume_after_kill(cluster, runtime, "lightning_gpt", 22, 21, "--steps", 24)
