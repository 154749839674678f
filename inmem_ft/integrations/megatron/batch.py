"""Megatron's global batch on the data-parallel size a job runs on now: --global-batch-size and
--micro-batch-size are kept, the number of micro-batches (Megatron's gradient accumulation, which its
micro-batch calculator derives from the three) covers the rest (globalbatch.py). Megatron's calculator refuses
a global batch that does not divide by micro x DP, as one written for the original node count may after a
shrink: there the block's on_shrink decides, where install() runs before Megatron checks the batch. It does not
yet on every release: megatron-core 0.18+ builds the calculator inside parse_and_validate_args, and every release's
validate_args checks --eval-global-batch-size (default: the global batch) against micro x DP, both before
install() runs, so there a global batch that does not divide stops with Megatron's own assertion."""
from __future__ import annotations

import logging

from ...globalbatch import Batch, for_dp

log = logging.getLogger("inmem_ft.megatron")


def keep_global_batch(args, on_shrink: str) -> Batch | None:
    """Set args.global_batch_size to what trains on this DP size (the same where it divides, else what
    `on_shrink` says; GlobalBatchRefused for "refuse"). Returns the Batch, or None where Megatron changes the
    batch itself over the run (--rampup-batch-size, a step schedule): those are Megatron's to settle."""
    if getattr(args, "rampup_batch_size", None) or getattr(args, "step_batch_size_schedule", None):
        return None
    # Megatron's calculator counts the weight-rematerialization replicas as data-parallel ranks too.
    dp = args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
    batch = for_dp(args.global_batch_size, args.micro_batch_size, dp, on_shrink)
    if not batch.kept:
        log.warning("%s", batch.note())
        # The scheduler counts samples, and Megatron checks its totals (iterations x global batch) against the
        # snapshot's on load: with another global batch the snapshot's schedule, in samples, goes on instead.
        args.use_checkpoint_opt_param_scheduler = True
    args.global_batch_size = batch.size
    return batch
