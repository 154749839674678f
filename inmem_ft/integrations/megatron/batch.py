"""Megatron's global batch on the data-parallel size a job runs on now: --global-batch-size and --micro-batch-size are
kept, the number of micro-batches (Megatron's gradient accumulation, which its micro-batch calculator derives from
the three) covers the rest (globalbatch.py). Megatron refuses a global batch that does not divide by micro x DP, as
one written for the original node count may after a shrink, with an assertion; from megatron-core 0.18 inside
parse_and_validate_args (validate_args checks --eval-global-batch-size, by default the global batch, and the
calculator is built there), before install() could act. So the fit is made where the arguments pass through us
first, on every release: add_args hands Megatron a parser whose parse yields arguments already fitted
(args.fit_when_parsed), and the block's on_shrink decides where the batch does not divide. An explicit
--eval-global-batch-size stays Megatron's to check."""
from __future__ import annotations

import logging

from ...globalbatch import Batch, for_dp

log = logging.getLogger("inmem_ft.megatron")


def keep_global_batch(args, on_shrink: str, dp: int) -> Batch | None:
    """Set args.global_batch_size to what trains on `dp` data-parallel ranks, counted as Megatron's calculator
    counts them (with the weight-rematerialization replicas): the same where it divides, else what `on_shrink`
    says (GlobalBatchRefused for "refuse"). Returns the Batch, or None where Megatron settles the batch itself:
    none given (micro x DP), or one it changes over the run (--rampup-batch-size, a step schedule)."""
    if args.global_batch_size is None or getattr(args, "rampup_batch_size", None) or \
            getattr(args, "step_batch_size_schedule", None):
        return None
    batch = for_dp(args.global_batch_size, args.micro_batch_size, dp, on_shrink)
    if not batch.kept:
        log.warning("%s", batch.note())
        # The scheduler counts samples, and Megatron checks its totals (iterations x global batch) against the
        # snapshot's on load: with another global batch the snapshot's schedule, in samples, goes on instead.
        args.use_checkpoint_opt_param_scheduler = True
    args.global_batch_size = batch.size
    return batch
