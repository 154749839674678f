"""Stock DeepSpeed checkpoint resume reproduces the uninterrupted run bit for bit.

This proves the harness deterministic and its list of state complete (DeepSpeed's files plus each
rank's RNG and data position), so any later mismatch with our own engine is our engine's fault.
"""
import pytest

from ds_harness import FORGETTABLE, HarnessConfig, assert_same_losses, check_resume, run_resume

SAVE, KILL = 3, 5


@pytest.mark.slow  # checks DeepSpeed and the harness, not inmem_ft: kept out of the default suite's time
@pytest.mark.parametrize("stage", [1, 3])
def test_stock_resume_is_bit_exact(stage, tmp_path):
    check_resume(HarnessConfig(stage=stage, world_size=2, steps=8), tmp_path,
                 save_step=SAVE, kill_rank=1, kill_step=KILL)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stock_resume_matrix(stage, dtype, world_size, tmp_path):
    check_resume(HarnessConfig(stage=stage, dtype=dtype, world_size=world_size, steps=8), tmp_path,
                 save_step=SAVE, kill_rank=world_size - 1, kill_step=KILL)


@pytest.mark.slow
def test_each_piece_of_rank_state_is_needed(tmp_path):
    # Negative control: if dropping any one piece still resumed exactly, the harness could not tell
    # us that an engine forgot it.
    cfg = HarnessConfig(stage=1, world_size=2, steps=6)
    runs = check_resume(cfg, tmp_path, save_step=SAVE, kill_rank=1, kill_step=KILL)
    for piece in FORGETTABLE:
        resumed = run_resume(cfg, tmp_path / f"forget-{piece}", ckpt_dir=tmp_path / "ckpt", forget=(piece,))
        with pytest.raises(AssertionError):
            assert_same_losses(runs["ref"], resumed)
