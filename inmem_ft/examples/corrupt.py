"""The examples' test hooks for a state that is saved bad with valid checksums (issue 40's tests). First attempt
only (a restart must not redo them).

$INMEM_FT_TEST_CORRUPT_AT=S: right after the optimizer step of step S, before that step's snapshot, rank 0 makes
one Adam second moment negative. The snapshot's checksums then cover the bad bytes; a run restored from it trains
one good step, whose update is NaN, and the next loss is NaN.

$INMEM_FT_TEST_SPIKE_AT=S: at the same place rank 0 multiplies its first parameter by 30: finite, but a run
restored from that snapshot shows a loss far above the ones before it (a spike without NaN).

$INMEM_FT_TEST_FLIP_AT=S (and $INMEM_FT_TEST_FLIP_RANK=R, default 1): right after the optimizer step of step S,
rank R flips one bit of its first parameter (in the DeepSpeed example: the module's), as silent data corruption
would: its replica of the weights differs from the others' from then on (what the replica fingerprints catch).
"""
from __future__ import annotations

import os

import torch

CORRUPT_AT = "INMEM_FT_TEST_CORRUPT_AT"
SPIKE_AT, SPIKE = "INMEM_FT_TEST_SPIKE_AT", 30.0
FLIP_AT, FLIP_RANK = "INMEM_FT_TEST_FLIP_AT", "INMEM_FT_TEST_FLIP_RANK"


def asked(variable: str = CORRUPT_AT) -> int | None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return int(os.environ.get(variable, "0")) or None


def after_step(optimizer, rank: int, step_of) -> None:
    """Hook `optimizer` (a torch optimizer); `step_of()`: the training step its next step() completes."""
    nan_at, spike_at = asked(), asked(SPIKE_AT)
    if rank != 0 or (nan_at is None and spike_at is None):
        return

    def hook(opt, *_):
        if step_of() == nan_at:
            state = next(s for s in opt.state.values() if "exp_avg_sq" in s)
            state["exp_avg_sq"].view(-1)[0] = -1e3
        if step_of() == spike_at:
            with torch.no_grad():
                opt.param_groups[0]["params"][0].mul_(SPIKE)

    optimizer.register_step_post_hook(hook)


def flip_after_step(optimizer, rank: int, step_of) -> None:
    """Hook `optimizer` (a torch optimizer) to flip a bit of one weight on rank $INMEM_FT_TEST_FLIP_RANK."""
    at = _flip_asked(rank)
    if at is None:
        return

    def hook(opt, *_):
        if step_of() == at:
            _flip(opt.param_groups[0]["params"][0])

    optimizer.register_step_post_hook(hook)


def flip_after_model_step(engine, rank: int) -> None:
    """The same for a DeepSpeed engine: after the optimizer step (and ZeRO's gather of the updated weights) of
    step S, before its snapshot, rank R flips a bit of the module's first parameter."""
    at = _flip_asked(rank)
    if at is None:
        return
    stock = engine._take_model_step

    def take(*args, **kwargs):
        out = stock(*args, **kwargs)
        if engine.global_steps == at:
            _flip(next(engine.module.parameters()))
        return out

    engine._take_model_step = take


def _flip_asked(rank: int) -> int | None:
    at = asked(FLIP_AT)
    return at if at is not None and rank == int(os.environ.get(FLIP_RANK, "1")) else None


def _flip(param) -> None:
    with torch.no_grad():
        param.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(0x40)
