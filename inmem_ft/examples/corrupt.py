"""The examples' test hook for a state that is saved bad with valid checksums (issue 40's sentinel tests).

$INMEM_FT_TEST_CORRUPT_AT=S: right after the optimizer step of step S, before that step's snapshot, rank 0 makes
one Adam second moment negative. The snapshot's checksums then cover the bad bytes; a run restored from it trains
one good step, whose update is NaN, and the next loss is NaN. First attempt only (a restart must not redo it).
"""
from __future__ import annotations

import os

CORRUPT_AT = "INMEM_FT_TEST_CORRUPT_AT"


def asked() -> int | None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return int(os.environ.get(CORRUPT_AT, "0")) or None


def after_step(optimizer, rank: int, step_of) -> None:
    """Hook `optimizer` (a torch optimizer); `step_of()`: the training step its next step() completes."""
    at = asked()
    if at is None or rank != 0:
        return

    def hook(opt, *_):
        if step_of() == at:
            state = next(s for s in opt.state.values() if "exp_avg_sq" in s)
            state["exp_avg_sq"].view(-1)[0] = -1e3

    optimizer.register_step_post_hook(hook)
