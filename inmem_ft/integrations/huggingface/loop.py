"""An accelerate loop of one's own: the DeepSpeed engine accelerator.prepare() built goes to the DeepSpeed
adapter as it is; the loop's position travels in extra_state (called inside engine.step(), which accelerate
runs inside accelerator.backward(), before the loop moves its counter)."""
from __future__ import annotations

from typing import Any, Callable

from ...errors import ConfigError


def install_accelerator(accelerator, extra_state: Callable[[], Any] | None):
    from ..deepspeed import install

    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        raise ConfigError("inmem_ft: install(accelerator) found no DeepSpeed engine; call it after "
                          "accelerator.prepare(model, optimizer, ...) with a DeepSpeedPlugin (or `accelerate launch` "
                          "with a DeepSpeed config)")
    return install(wrapped.engine, extra_state=extra_state)
