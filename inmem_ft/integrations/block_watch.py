"""The `"inmem_ft"` block alone is not a silent no-op: DeepSpeed, the Hugging Face Trainer, accelerate and
Lightning all accept the block and ignore it, so a job whose engine nobody handed to install() would train
unprotected and say nothing. Once armed (any `import inmem_ft` arms it), the first optimizer step of an engine
whose config holds an enabled block that install() never saw logs one line on rank 0 with the line to add."""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger("inmem_ft.deepspeed")
ENGINE_MODULE = "deepspeed.runtime.engine"
ADVICE = ("inmem_ft: the DeepSpeed config has an enabled \"inmem_ft\" block but nothing installed it on this "
          "engine, so no snapshot is taken; add `inmem_ft.integrations.deepspeed.install(engine)` after "
          "deepspeed.initialize (Hugging Face Trainer: `inmem_ft.integrations.huggingface.install(trainer)` before "
          "trainer.train(); accelerate: `inmem_ft.integrations.huggingface.install(accelerator)` after "
          "accelerator.prepare(...)), or set \"enabled\": false")


def _enabled_block(engine) -> bool:
    block = getattr(getattr(engine, "_config", None), "_param_dict", {}).get("inmem_ft")
    return isinstance(block, dict) and block.get("enabled", True) is not False


def check(engine) -> None:
    """At an engine's first optimizer step: the line above, on rank 0, once per engine."""
    if getattr(engine, "inmem_ft_checked", False):
        return
    engine.inmem_ft_checked = True
    if getattr(engine, "inmem_ft_installed", False) or not _enabled_block(engine):
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(ADVICE)


def patch_engine_class(module) -> None:
    """Wrap DeepSpeedEngine._take_model_step, the optimizer step of engine.step() and of a pipeline's
    train_batch() alike."""
    cls = module.DeepSpeedEngine
    take = cls._take_model_step
    if getattr(take, "_inmem_ft_watch", False):
        return

    @functools.wraps(take)
    def watched(self, *a, **kw):
        check(self)
        return take(self, *a, **kw)

    watched._inmem_ft_watch = True
    cls._take_model_step = watched


class _Finder(importlib.abc.MetaPathFinder):
    """Patches deepspeed.runtime.engine as it is imported (inmem_ft never imports DeepSpeed itself for this)."""

    def find_spec(self, name, path=None, target=None):
        if name != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch_engine_class(module)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]

        spec.loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Watch every DeepSpeed engine of this process: now if DeepSpeed's engine module is loaded, else when it is."""
    if ENGINE_MODULE in sys.modules:
        patch_engine_class(sys.modules[ENGINE_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
