"""The hook points docs/deepspeed-checkpoint-flow.md recommends carry a bit-exact resume with no pickle and no
checkpoint files: a CheckpointEngine swapped into the DeepSpeed engine, plus a skeleton directory."""
import pytest

from ds_harness import HarnessConfig, check_resume

BACKEND = "ds_inmem_proto:ProtoCheckpoint"


def test_inmem_engine_resume_is_bit_exact(tmp_path):
    # ZeRO-2 bf16 carries every non-plain type the codec must handle (LossScaler, ZeroStageEnum,
    # fragment_address, OrderedDict, torch.Size) and the bf16_ file-name prefix.
    check_resume(HarnessConfig(stage=2, dtype="bf16", world_size=2, steps=8), tmp_path,
                 save_step=3, kill_rank=1, kill_step=5, backend=BACKEND)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inmem_engine_resume_matrix(stage, dtype, world_size, tmp_path):
    check_resume(HarnessConfig(stage=stage, dtype=dtype, world_size=world_size, steps=8), tmp_path,
                 save_step=3, kill_rank=0, kill_step=5, backend=BACKEND)
