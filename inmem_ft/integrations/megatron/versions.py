"""What differs between the megatron-core releases the adapter runs on (inmem_ft.compat.TESTED), in one place:
the calls the snapshot path (patch.snapshot_without_save_checkpoint) makes the way each release's own
save_checkpoint makes them.

- 0.19 resolves the checkpoint's process groups from the model's ProcessGroupCollection and hands them to
  get_rng_state, maybe_save_dataloader_state and the tensor-aware state dict; force_param_sync takes the
  optimizer too. 0.18's save_checkpoint uses Megatron's global (mpu) groups and takes no groups in those calls.
- A torch_dist checkpoint's common state (args, iteration, scheduler, ...): 0.19 keeps it among the shards as the
  ShardedObject `common_state`; 0.18 in `common.pt` beside them, the file its loader reads (common_state_file).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from packaging.version import Version


@functools.cache
def release() -> tuple[int, int]:
    """megatron-core's (major, minor)."""
    from megatron.core.package_info import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class Groups:
    """The process groups a save uses; dp and dp_cp None where the release takes Megatron's global ones."""
    tp: Any
    pp: Any
    dp: Any = None
    dp_cp: Any = None
    rng_key_prefix: str = ""


def checkpoint_groups(model) -> Groups:
    """The groups the release's save_checkpoint_and_time hands save_checkpoint for `model` (its chunks)."""
    from megatron.core import mpu
    from megatron.core.utils import unwrap_model

    tp, pp = mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
    if release() < (0, 19):
        return Groups(tp, pp)
    first = unwrap_model(model)[0]
    pgc = getattr(first, "pg_collection", None)
    return Groups(getattr(pgc, "tp", None) or tp, getattr(pgc, "pp", None) or pp, getattr(pgc, "dp", None),
                  getattr(pgc, "dp_cp_gtp_remat", None), getattr(first, "rng_state_key_prefix", ""))


def force_param_sync(model, optimizer) -> None:
    from megatron.training import training

    if release() < (0, 19):
        training.force_param_sync(model)
    else:
        training.force_param_sync(model, optimizer=optimizer)


def rng_state(args, groups: Groups):
    from megatron.training import checkpointing

    if release() < (0, 19):
        return checkpointing.get_rng_state(args.ckpt_format, groups.tp, groups.pp)
    return checkpointing.get_rng_state(args.ckpt_format, groups.tp, groups.pp, dp_cp_group=groups.dp_cp,
                                       dp_group=groups.dp, key_prefix=groups.rng_key_prefix)


def save_dataloader_state(iterator, iteration: int, args, groups: Groups) -> None:
    from megatron.training import checkpointing

    path = getattr(args, "dataloader_save", None)
    if release() < (0, 19):
        checkpointing.maybe_save_dataloader_state(iterator, iteration, path)
    else:
        checkpointing.maybe_save_dataloader_state(iterator, iteration, path, tp_group=groups.tp,
                                                  pp_group=groups.pp, dp_group=groups.dp)


def common_state_file(version: str) -> str | None:
    """The file of a torch_dist checkpoint directory that holds the common state, for megatron-core `version`
    where it keeps it in one (0.18's save_common: torch.save of the dict); None where it is a ShardedObject."""
    return "common.pt" if Version(version).release[:2] < (0, 19) else None
