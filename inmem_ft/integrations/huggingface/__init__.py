"""Hugging Face adapter: the `"inmem_ft"` block in the DeepSpeed JSON and one line, over the DeepSpeed adapter
(which keeps all the snapshot and restore logic):

    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config), ...)
    inmem_ft.integrations.huggingface.install(trainer)          # before trainer.train()

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    handle = inmem_ft.integrations.huggingface.install(accelerator, extra_state=lambda: {"step": step + 1})

See docs/huggingface.md for what each restores.
"""
from __future__ import annotations

from typing import Any, Callable

from ... import compat
from ...errors import ConfigError


def install(target, *, extra_state: Callable[[], Any] | None = None, allow_untested: bool = False):
    """Protect a transformers.Trainer (call before trainer.train(); returns a TrainerAdapter) or an
    accelerate.Accelerator whose DeepSpeed engine accelerator.prepare() built (returns the DeepSpeed Handle).
    None when the DeepSpeed config has no enabled inmem_ft block."""
    import accelerate

    compat.check("accelerate", accelerate.__version__, allow_untested)
    if isinstance(target, accelerate.Accelerator):
        from .loop import install_accelerator

        return install_accelerator(target, extra_state)
    import transformers

    if isinstance(target, transformers.Trainer):
        if extra_state is not None:
            raise ConfigError("inmem_ft: install(trainer) carries the Trainer's own state; extra_state is for an "
                              "accelerate loop of one's own")
        compat.check("transformers", transformers.__version__, allow_untested)
        from .trainer import TrainerAdapter

        return TrainerAdapter.install(target)
    raise ConfigError(f"inmem_ft: install() takes a transformers.Trainer or an accelerate.Accelerator, got "
                      f"{type(target).__name__}; for a DeepSpeed engine use inmem_ft.integrations.deepspeed.install")


__all__ = ["install"]
