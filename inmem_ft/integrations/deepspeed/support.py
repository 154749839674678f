"""What the DeepSpeed adapter handles, checked before install() touches the engine: a layout we do not
capture correctly must be refused at start, not discovered at restore as a silently wrong model."""
from __future__ import annotations

from ... import compat
from ...errors import ConfigError
from . import moe, tensor_parallel

_WITHOUT = "remove the inmem_ft block (or set \"enabled\": false) to train with DeepSpeed's own checkpoints"


def check_supported(engine, version: str | None = None, allow_untested: bool = False) -> None:
    """Raise ConfigError, one line saying what is unsupported and what to do, for an engine whose layout the
    adapter would mis-save. `version`: DeepSpeed's (default: the installed one), checked against the tested
    range of inmem_ft.compat (save_checkpoint's file set and ZeRO's partitioning change between releases);
    `allow_untested`: run an untested one with a warning."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    compat.check("deepspeed", version, allow_untested, without=_WITHOUT)
    check_model_parallel(engine)
    if getattr(engine, "has_moe_layers", False):
        moe.check_supported(engine, _WITHOUT)
    for what, offload in (("optimizer", engine.zero_offload_optimizer()), ("parameter", engine.zero_offload_param())):
        device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
        if device not in (None, "none"):
            raise ConfigError(f"inmem_ft: ZeRO {what} offload to {device} is not supported; remove "
                              f"zero_optimization.offload_{'param' if what == 'parameter' else what}, or {_WITHOUT}")


def check_model_parallel(engine) -> None:
    """Pipeline stages through a PipelineModule with ZeRO-0/1 are handled (pipeline.py), and tensor parallelism
    through an `mpu` (tensor_parallel.py) with ZeRO-0/1/2; AutoTP training, tensor parallelism under ZeRO-3,
    and pipeline stages an `mpu` declares without a PipelineModule are refused by name."""
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size

    pipeline = getattr(engine, "pipeline_parallelism", False)
    mpu = getattr(engine, "mpu", None)
    tensor_parallel.check_autotp(engine)
    tp = tensor_parallel.size_of(engine)
    if tp > 1 and int(engine.zero_optimization_stage()) == 3:
        raise ConfigError(f"inmem_ft: tensor parallelism (size {tp}) under ZeRO-3 is not supported; use ZeRO-1 or "
                          f"2 with the mpu, or {_WITHOUT}")
    if not pipeline and bwc_pipeline_parallel_world_size(mpu) > 1:
        raise ConfigError(f"inmem_ft: pipeline stages declared by an mpu without a PipelineModule are not "
                          f"supported; build the model as a deepspeed.pipe.PipelineModule, or {_WITHOUT}")
    if pipeline and int(engine.zero_optimization_stage()) == 0 and _bf16_optimizer(engine):
        # ZeRO-0 saves this optimizer's DP-partitioned state inside the model states, which the DP replicas
        # share in a snapshot: it would restore one replica's partition on all of them. (DeepSpeed itself
        # refuses ZeRO-2/3 under a pipeline.)
        raise ConfigError("inmem_ft: bf16 under a PipelineModule with ZeRO-0 (DeepSpeed's BF16_Optimizer, which "
                          "partitions the optimizer across data-parallel ranks) is not supported; set "
                          "zero_optimization.stage to 1")


def _bf16_optimizer(engine) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(engine.optimizer, BF16_Optimizer)
