"""The non-plain classes DeepSpeed 0.19.8 puts into checkpoint dicts (tests/ds_state_probe.py lists them for a
new release), allowed both in snapshots and in torch.load(weights_only=True) of stock files."""
from __future__ import annotations

import contextlib


def deepspeed_classes() -> list[type]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def register() -> None:
    from ...snapshot import register_safe_class

    register_safe_class(*deepspeed_classes())


def safe_load_context():
    """torch.load(weights_only=True) of a stock DeepSpeed file needs exactly these globals allowed."""
    import torch

    add = getattr(torch.serialization, "safe_globals", None)
    return add(deepspeed_classes()) if add else contextlib.nullcontext()
