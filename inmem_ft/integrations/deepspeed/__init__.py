"""DeepSpeed adapter: one `"inmem_ft": {...}` block in the DeepSpeed JSON and one line after initialize:

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    handle = inmem_ft.integrations.deepspeed.install(engine, extra_state=lambda: {"position": stream.position})

engine.save_checkpoint / load_checkpoint keep working and go to the SMP (load from memory when it holds
the tag, else from disk). See handle.py for the flow and docs/design.md for DeepSpeed.
"""
from .batch import keep_global_batch
from .handle import Handle, Restored, install


def initialize(*args, **kwargs):
    """deepspeed.initialize, then install() when the config has an enabled inmem_ft block.

    Returns DeepSpeed's tuple; the handle is `engine.inmem_ft` (None when disabled). Extra state cannot be
    passed here: call install() yourself for that. A config dict that gives train_batch_size and the micro batch
    keeps its global batch on whatever data-parallel size the job runs on (keep_global_batch; without an `mpu`,
    DP is the world size).
    """
    import os

    import deepspeed

    cpu_setup()
    if isinstance(kwargs.get("config"), dict) and kwargs.get("mpu") is None:
        kwargs["config"] = keep_global_batch(kwargs["config"], int(os.environ.get("WORLD_SIZE", "1")))
    out = deepspeed.initialize(*args, **kwargs)
    out[0].inmem_ft = install(out[0])
    return out


def cpu_setup() -> None:
    """On CPU, what DeepSpeed needs to train there: no JIT build of deepspeed_shm_comm (70-120 s), which training
    never uses (docs/design.md, "How the DeepSpeed adapter hooks DeepSpeed"), and on 0.18 a ZeRO-1/2 step that gloo
    can finish (versions.gloo_all_gather_without_autograd). Call before deepspeed.initialize/init_distributed; on a
    GPU it does nothing."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops

        from . import versions

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        versions.gloo_all_gather_without_autograd()


__all__ = ["install", "initialize", "Handle", "Restored", "cpu_setup", "keep_global_batch"]
