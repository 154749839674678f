"""What the DeepSpeed adapter handles, checked before install() touches the engine: a layout we do not
capture correctly must be refused at start, not discovered at restore as a silently wrong model."""
from __future__ import annotations

from ... import compat
from ...errors import ConfigError

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
    if getattr(engine, "pipeline_parallelism", False):
        raise ConfigError(f"inmem_ft: pipeline parallelism (a PipelineModule / PipelineEngine) is not supported; "
                          f"train without pipeline stages, or {_WITHOUT}")
    if getattr(engine, "has_moe_layers", False):
        raise ConfigError(f"inmem_ft: mixture-of-experts layers (expert-parallel state) are not supported; "
                          f"{_WITHOUT}")
    for what, offload in (("optimizer", engine.zero_offload_optimizer()), ("parameter", engine.zero_offload_param())):
        device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
        if device not in (None, "none"):
            raise ConfigError(f"inmem_ft: ZeRO {what} offload to {device} is not supported; remove "
                              f"zero_optimization.offload_{'param' if what == 'parameter' else what}, or {_WITHOUT}")
