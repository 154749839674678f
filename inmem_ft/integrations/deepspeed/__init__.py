"""DeepSpeed adapter: one `"inmem_ft": {...}` block in the DeepSpeed JSON and one line after initialize:

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    handle = inmem_ft.integrations.deepspeed.install(engine, extra_state=lambda: {"position": stream.position})

engine.save_checkpoint / load_checkpoint keep working and go to the SMP (load from memory when it holds
the tag, else from disk). See handle.py for the flow and docs/design.md for DeepSpeed.
"""
from .handle import Handle, Restored, install


def initialize(*args, **kwargs):
    """deepspeed.initialize, then install() when the config has an enabled inmem_ft block.

    Returns DeepSpeed's tuple; the handle is `engine.inmem_ft` (None when disabled). Extra state cannot be
    passed here: call install() yourself for that.
    """
    import deepspeed

    disable_cpu_shm_comm()
    out = deepspeed.initialize(*args, **kwargs)
    out[0].inmem_ft = install(out[0])
    return out


def disable_cpu_shm_comm() -> None:
    """On CPU, keep DeepSpeed from JIT-compiling deepspeed_shm_comm (70-120 s), which training never uses
    (docs/design.md, "How the DeepSpeed adapter hooks DeepSpeed"). Call before deepspeed.initialize/init_distributed."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


__all__ = ["install", "initialize", "Handle", "Restored", "disable_cpu_shm_comm"]
