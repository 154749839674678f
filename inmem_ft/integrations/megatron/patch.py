"""Every change this adapter makes to Megatron, in one place. All are tied to the megatron-core releases of
inmem_ft.compat.TESTED (check_version refuses others), the calls that differ between them made through
versions.py; each says why the stock code cannot do without it.
"""
from __future__ import annotations

import functools

from ... import compat
from . import versions


def installed_version() -> str:
    """megatron-core's release. The wheel appends '+<git hash>' when a git checkout happens to enclose
    site-packages: not part of the release."""
    from megatron.core.package_info import __version__

    return __version__.split("+")[0]


def check_version(allow_untested: bool = False) -> str:
    """The installed release, if its checkpoint hooks are the ones patched here (else ConfigError, or with
    `allow_untested` a warning)."""
    return compat.check("megatron-core", installed_version(), allow_untested,
                        without="train without --inmem-ft")


def register_safe_classes(args=None) -> None:
    """The common part of Megatron's state (args, rerun state) holds a Namespace and Enums; allow exactly
    those in snapshots: Megatron's enum modules (`args.model_type` is set only later, in get_model) and the
    enums already in args (e.g. signal.Signals). Without `args` (a tool decoding a snapshot): signal.Signals,
    the one such enum Megatron's own safe globals name."""
    import argparse
    import enum
    import signal

    import megatron.core.enums
    import megatron.core.rerun_state_machine
    import megatron.core.transformer.enums

    from ...snapshot import register_safe_class

    in_args = ({type(v) for v in vars(args).values() if isinstance(v, enum.Enum)} if args is not None
               else {signal.Signals})
    register_safe_class(argparse.Namespace, *in_args)
    for module in (megatron.core.enums, megatron.core.transformer.enums, megatron.core.rerun_state_machine):
        register_safe_class(*(v for v in vars(module).values()
                              if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__))


def allow_local_tasd() -> None:
    """MCoreTensorAwareStateDict.from_state_dict refuses to run without nvidia-resiliency-ext, whose only
    use there is the base class; it does not install next to 0.19.2 on Python 3.11 (MEGATRON.md)."""
    from megatron.core.dist_checkpointing import tensor_aware_state_dict

    tensor_aware_state_dict.HAVE_NVRX = True


def validate_structure_once() -> None:
    """Under --ckpt-assume-constant-structure Megatron validates the sharding of a torch_dist save only the first
    time. Its local saves are meant to skip it through the cached shard distribution, but that distribution is
    None when the data-parallel group has one rank (nothing to distribute), so 0.19.2 validates every local save
    again: two all_gather_object rounds over the whole job, every snapshot. Validate the first, as torch_dist does.
    Only MCoreTensorAwareStateDict.from_state_dict (the local save) reads this module's save_preprocess."""
    from megatron.core.dist_checkpointing import tensor_aware_state_dict

    preprocess = tensor_aware_state_dict.save_preprocess
    validated = [False]

    @functools.wraps(preprocess)
    def once(sharded_state_dict, validate_access_integrity=True, *args, **kwargs):
        validate = validate_access_integrity and not validated[0]
        validated[0] = validated[0] or validate
        return preprocess(sharded_state_dict, validate, *args, **kwargs)

    tensor_aware_state_dict.save_preprocess = once


def finalize_when_committed() -> None:
    """With --async-save Megatron finalizes a save (its finalize functions, then its "successfully saved" line)
    once the save's caller reports it done on every rank, which it asks at the start of every iteration. A
    request without a worker process (`async_fn` None: ours, whose commit thread does the work) it reports done
    at once, so our finalize, which waits for the commit, blocked the next iteration for all of it (the copy,
    checksums, the SMP commit, the job-wide vote: 0.05-0.35 s a snapshot here). A request without `async_fn`
    whose one argument is a Future (the commit, manager.save) gets a caller that reports done when that commit
    is, through the same all-reduce as the stock callers; the queue's other requests keep theirs."""
    from concurrent.futures import Future, wait

    from megatron.core.dist_checkpointing.strategies import async_utils

    class CommitCaller(async_utils.AsyncCaller):
        def __init__(self, commit: Future):
            self.commit = commit

        def schedule_async_call(self, async_req) -> None:
            pass  # already running on the commit thread

        def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
            if blocking:
                wait([self.commit])
            alive = int(not self.commit.done())
            return not alive if no_dist else bool(self.sync_all_async_calls(alive))

        def close(self, abort: bool = False) -> None:
            pass  # no process to join: the Snapshotter's close() waits for the commit

        def __del__(self):
            pass

    schedule = async_utils.AsyncCallsQueue.schedule_async_request

    @functools.wraps(schedule)
    def scheduled(self, async_request):
        args = async_request.async_fn_args
        if async_request.async_fn is not None or len(args) != 1 or not isinstance(args[0], Future):
            return schedule(self, async_request)
        self.call_idx += 1
        self.async_calls.append(async_utils._ActiveAsyncRequest(self.call_idx, CommitCaller(args[0]),
                                                                async_request.freeze()))
        return self.call_idx

    async_utils.AsyncCallsQueue.schedule_async_request = scheduled


def snapshot_without_save_checkpoint(manager_type) -> None:
    """pretrain() makes its non-persistent saves, ours, through save_checkpoint_and_time, which wraps the save in
    what a checkpoint written to storage needs: it stops and restarts its interval timer behind a job-wide
    barrier, all-gathers the save's time over the ranks to log it, reports memory, prints. Those collectives
    cost 5-20 ms a snapshot on the benchmark box, more than building the state; a snapshot needs none of them
    (the Snapshotter votes on its commit thread). So a non-persistent save with `manager_type` in the context
    builds the same tensor-aware state dict as save_checkpoint does for 'local' checkpoints (the same
    Megatron calls, in the same order, with the same groups) and hands it to that manager. Persistent saves,
    and any other caller of save_checkpoint, stay stock."""
    from megatron.core import mpu
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import unwrap_model
    from megatron.training import checkpointing, get_args, training

    stock = training.save_checkpoint_and_time

    @functools.wraps(stock)
    def wrapped(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                checkpointing_context, non_persistent_ckpt=False, train_data_iterator=None):
        args = get_args()
        manager = (checkpointing_context or {}).get("local_checkpoint_manager")
        if not (non_persistent_ckpt and args.non_persistent_ckpt_type == "local" and isinstance(manager, manager_type)):
            return stock(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                         checkpointing_context, non_persistent_ckpt, train_data_iterator)
        if training.should_disable_forward_pre_hook(args):  # as save_checkpoint_and_time: gathered params
            versions.force_param_sync(model, optimizer)
        groups = versions.checkpoint_groups(model)
        rng_state = versions.rng_state(args, groups)
        rerun_state = get_rerun_state_machine().state_dict(data_iterator=train_data_iterator,
                                                            ckpt_format=args.ckpt_format)
        versions.save_dataloader_state(train_data_iterator, iteration, args, groups)
        metadata = checkpointing._build_sharded_state_dict_metadata(args, dp_cp_group=groups.dp_cp)
        if metadata.get("distrib_optim_sharding_type") in ("fully_reshardable", "dp_zero_gather_scatter"):
            raise RuntimeError(f"Local checkpointing does not support optimizer sharding type "
                               f"'{metadata['distrib_optim_sharding_type']}'. Don't use "
                               f"'--dist-ckpt-optim-fully-reshardable' when saving local checkpoints.")
        state_dict = checkpointing.generate_state_dict(args, unwrap_model(model), optimizer, opt_param_scheduler,
                                                       rng_state, iteration=iteration,
                                                       optim_sd_kwargs=dict(metadata=metadata),
                                                       model_sd_kwargs=dict(metadata=metadata), rerun_state=rerun_state)
        state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
        cached = checkpointing_context.get("local_checkpoint_cache") if args.ckpt_assume_constant_structure else None
        tasd, cacheable = MCoreTensorAwareStateDict.from_state_dict(
            state_dict, algo=args.non_persistent_local_ckpt_algo, cached_metadata=cached,
            parallelization_group=groups.dp_cp or mpu.get_data_parallel_group(with_context_parallel=True))
        manager.save(tasd, iteration, is_async=False)  # the commit thread finishes it: nothing to finalize
        checkpointing_context["local_checkpoint_cache"] = cacheable

    training.save_checkpoint_and_time = wrapped


def observe_train_step(observe) -> None:
    """After each train_step of pretrain()'s loop: `observe(iteration, loss_dict, grad_norm, skipped)`, the
    iteration it completed and what it returned (the loss dict is empty off the last pipeline stage)."""
    from megatron.training import get_args, training

    stock = training.train_step

    @functools.wraps(stock)
    def wrapped(*args, **kwargs):
        out = stock(*args, **kwargs)
        observe(get_args().curr_iteration + 1, out[0], out[5], bool(out[1]))
        return out

    training.train_step = wrapped


def screened_steps_to_sentinel(screening) -> None:
    """While inmem_ft screens the steps after a restore (`screening()`: capture/sentinel.py), Megatron's rerun
    state machine leaves their results to it. Its NaN check of a gradient bucket runs inside backward, before
    train_step returns the loss to the sentinel, and (in its default validate_results mode) reruns the step, saves
    a persistent checkpoint of the bad state to --save and exits: that checkpoint would be the newest on disk, and
    no rollback would follow. The sentinel sees the same NaN in the loss or grad norm that train_step returns,
    agreed by every rank, and rolls back to an older snapshot instead. Outside those steps the machine is stock."""
    from megatron.core.rerun_state_machine import RerunStateMachine

    stock = RerunStateMachine.validate_result

    @functools.wraps(stock)
    def wrapped(self, *args, **kwargs):
        if screening():
            return None
        return stock(self, *args, **kwargs)

    RerunStateMachine.validate_result = wrapped


def around_load(before, after) -> None:
    """pretrain() builds nvrx's manager itself (only when the cfg asks for 'local' checkpoints) and calls
    load_checkpoint inside setup_model_and_optimizer, once model and optimizer exist:
    `before(checkpointing_context, model, optimizer)` puts ours in place just ahead of that load and returns a
    context manager the load runs in, `after(model, optimizer, iteration loaded)` runs once it is done. Later
    loads (RL reference weights) stay stock.
    The load runs under no_grad: with fp32 parameters the distributed optimizer's main parameters are views
    of them, and 0.19.2 copies the loaded values into those in place (autograd refuses that otherwise)."""
    import torch
    from megatron.training import training

    load = training.load_checkpoint
    first = [True]

    @functools.wraps(load)
    def wrapped(model, optimizer, opt_param_scheduler, *args, checkpointing_context=None, **kwargs):
        if not first[0] or checkpointing_context is None:
            return load(model, optimizer, opt_param_scheduler, *args, checkpointing_context=checkpointing_context,
                        **kwargs)
        first[0] = False
        guard = before(checkpointing_context, model, optimizer)
        with torch.no_grad(), guard:
            out = load(model, optimizer, opt_param_scheduler, *args, checkpointing_context=checkpointing_context,
                       **kwargs)
        after(model, optimizer, out[0])
        return out

    training.load_checkpoint = wrapped


def fill_empty_optimizer_state(optimizer) -> None:
    """0.19.2's DistributedOptimizer.state_dict (without Apex/TE) asserts that its Adam state holds exactly one
    `step`, which a fresh optimizer's empty state does not: loading any checkpoint into it fails. Megatron's
    own remedy for that (used for its FSDP format) is one optimizer step on zero gradients; the load then
    overwrites every value it wrote."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def fence_before_step(optimizer, fence) -> None:
    """The snapshot's copy runs behind forward/backward; the optimizer step is the first thing to change the
    snapshotted tensors, so it waits for that copy (and only for it). MegatronOptimizer.step is not a
    torch.optim step, so it has no pre-hooks: the bound method is wrapped."""
    step = optimizer.step

    @functools.wraps(step)
    def fenced(*args, **kwargs):
        fence()
        return step(*args, **kwargs)

    optimizer.step = fenced


def restore_adam_steps(optimizer) -> None:
    """0.19.2's DistributedOptimizer.load_state_dict (without Apex/TE) gets Adam's `step` wrong twice: it
    gives every parameter the same tensor, which torch's Adam then increments once per parameter each step,
    and its bucket-state load then copies into that tensor the step the optimizer had *before* the load.
    Either way the bias correction silently drifts. The checkpoint's step is in the param groups: give each
    parameter its own tensor of it, as an optimizer that never stopped has. Other optimizers load per-parameter
    steps correctly; theirs are only unshared."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        distributed = hasattr(opt, "gbuf_ranges")
        for group in (inner.param_groups if inner is not None else ()):
            for param in group["params"]:
                state = inner.state.get(param, {})
                if not torch.is_tensor(state.get("step")):
                    continue
                if distributed and group.get("step") is not None:
                    state["step"] = torch.full_like(state["step"], float(group["step"]))
                else:
                    state["step"] = state["step"].clone()
