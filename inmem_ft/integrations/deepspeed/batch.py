"""DeepSpeed's batch triple for the data-parallel size a job runs on now: train_batch_size (the global batch)
and train_micro_batch_size_per_gpu are kept, gradient_accumulation_steps covers the rest (globalbatch.py).
DeepSpeed derives the accumulation itself only where the config leaves it out, and refuses a config whose
three values disagree, as a config written for the original node count does after a shrink."""
from __future__ import annotations

import logging

from ...config import InmemFTBlock
from ...globalbatch import for_dp

log = logging.getLogger("inmem_ft.deepspeed")
GLOBAL, MICRO, ACCUMULATION = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def keep_global_batch(config: dict, dp_size: int) -> dict:
    """`config` (a DeepSpeed config dict) with the gradient accumulation that keeps its global batch on `dp_size`
    data-parallel ranks; where none does, its inmem_ft block's on_shrink decides (a copy; the given dict is left
    as it is). A config without both train_batch_size and train_micro_batch_size_per_gpu is DeepSpeed's to
    settle: returned as it is."""
    if GLOBAL not in config or MICRO not in config:
        return config
    block = InmemFTBlock.from_framework_config(config)
    batch = for_dp(config[GLOBAL], config[MICRO], dp_size, block.on_shrink if block else "keep")
    if not batch.kept:
        log.warning("%s", batch.note())
    return {**config, GLOBAL: batch.size, ACCUMULATION: batch.accumulation}
