"""What differs between the megatron-core releases the adapter runs on (inmem_ft.compat.TESTED), in one place.

- How an entry script hands pretrain() its arguments: 0.18 and 0.19 parse and validate them first
  (parse_and_validate_args) and pass pretrain() a config built from them (pretrain_cfg_container_from_args);
  0.17 has neither: its pretrain() parses and validates them itself, in initialize_megatron. The entry script
  calls parse_and_validate_args, pretrain_config and pretrain below, which do either.
- The snapshot path (patch.snapshot_without_save_checkpoint) makes the calls each release's save_checkpoint
  makes. 0.19 resolves the checkpoint's process groups from the model's ProcessGroupCollection and hands them to
  get_rng_state, maybe_save_dataloader_state and the tensor-aware state dict; force_param_sync takes the
  optimizer too. 0.17's and 0.18's save_checkpoint use Megatron's global (mpu) groups and take none in those calls.
- A torch_dist checkpoint's common state (args, iteration, scheduler, ...): 0.19 keeps it among the shards as the
  ShardedObject `common_state`; 0.17 and 0.18 in `common.pt` beside them, where their loader reads it.
"""
from __future__ import annotations

import functools
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from packaging.version import Version


@functools.cache
def release() -> tuple[int, int]:
    """megatron-core's (major, minor)."""
    from megatron.core.package_info import __version__

    return Version(__version__).release[:2]


def parse_and_validate_args(extra_args_provider=None) -> Namespace:
    """Megatron's arguments and `extra_args_provider`'s, from the command line, validated (from 0.18 also made
    Megatron's global args; on 0.17 pretrain() makes them so)."""
    from megatron.training import arguments

    if release() >= (0, 18):
        return arguments.parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults={})
    args = arguments.parse_args(extra_args_provider)
    arguments.validate_args(args, {})
    return args


@dataclass(frozen=True)
class ArgsConfig:
    """0.17's pretrain() config: the args, and the two of them that 0.18+'s pretrain() itself reads from its
    config (taken before the adapter's install() changes them in the args): the non-persistent checkpoint type
    it builds its checkpointing context from ('local' would make it build nvidia-resiliency-ext's manager), and
    --save, for the persistent save after training (a run without --save makes none)."""
    args: Namespace
    non_persistent_ckpt_type: str | None
    save: str | None


def pretrain_config(args: Namespace):
    """What pretrain() takes as its config, built from `args` as they are now (before the adapter's install())."""
    if release() < (0, 18):
        return ArgsConfig(args, args.non_persistent_ckpt_type, args.save)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    return pretrain_cfg_container_from_args(args, None)


def pretrain(cfg, **providers) -> None:
    """Megatron's pretrain(cfg, ...), `providers` by keyword (train_valid_test_dataset_provider, model_provider,
    model_type, forward_step_func: 0.17 and 0.18 take model_provider second or third, 0.19 fifth).
    0.17's pretrain() has no config: its initialize_megatron parses and validates the command line itself, and
    its own body reads the args. Here its initialize_megatron takes cfg's args instead, validated already
    (validating them again after install() fails: install() sets --save for a run without one, and validation
    then asks for a --save-interval), and its body sees cfg's values where 0.18+'s reads its config: cfg's
    non-persistent type until the model and optimizer are set up (after the checkpointing context is built,
    before the load that reads the type), cfg's --save once train() returns."""
    from megatron.training import initialize as megatron_initialize
    from megatron.training import training

    if not isinstance(cfg, ArgsConfig):
        training.pretrain(cfg, **providers)
        return
    args, own = cfg.args, (cfg.args.non_persistent_ckpt_type, cfg.args.save)
    initialize, validate, setup, train = (training.initialize_megatron, megatron_initialize.validate_args,
                                          training.setup_model_and_optimizer, training.train)

    def initialize_with_args(*a, **kw):
        return initialize(*a, **kw, parsed_args=args)

    def setup_with_own_type(*a, **kw):
        args.non_persistent_ckpt_type = own[0]
        return setup(*a, **kw)

    def train_then_cfg_save(*a, **kw):
        out = train(*a, **kw)
        args.save = cfg.save
        return out

    args.non_persistent_ckpt_type = cfg.non_persistent_ckpt_type
    training.initialize_megatron, training.setup_model_and_optimizer, training.train = (
        initialize_with_args, setup_with_own_type, train_then_cfg_save)
    megatron_initialize.validate_args = lambda args, defaults=None: None  # parse_and_validate_args did
    try:
        training.pretrain(**providers)
    finally:
        training.initialize_megatron, training.setup_model_and_optimizer, training.train = initialize, setup, train
        megatron_initialize.validate_args = validate
        args.non_persistent_ckpt_type, args.save = own


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
    where it keeps it in one (0.17's and 0.18's save_common: torch.save of the dict); None where it is a
    ShardedObject among the shards."""
    return "common.pt" if Version(version).release[:2] < (0, 19) else None
