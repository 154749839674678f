"""Every change this adapter makes to Megatron, in one place. All are tied to megatron-core 0.19.2
(check_version refuses others); each says why the stock code cannot do without it.
"""
from __future__ import annotations

import functools

from ...errors import ConfigError

TESTED = ("0.19.2",)


def check_version() -> str:
    from megatron.core.package_info import __version__

    # The wheel appends '+<git hash>' when a git checkout happens to enclose site-packages: not a version
    release = __version__.split("+")[0]
    if release not in TESTED:
        raise ConfigError(f"--inmem-ft: megatron-core {release} is not supported; this inmem_ft is tested with "
                          f"megatron-core {', '.join(TESTED)} (pip install --ignore-requires-python "
                          f"megatron-core=={TESTED[-1]}), whose checkpoint hooks it patches")
    return release


def register_safe_classes(args) -> None:
    """The common part of Megatron's state (args, rerun state) holds a Namespace and Enums; allow exactly
    those in snapshots: Megatron's enum modules (`args.model_type` is set only later, in get_model) and the
    enums already in args (e.g. signal.Signals)."""
    import argparse
    import enum

    import megatron.core.enums
    import megatron.core.rerun_state_machine
    import megatron.core.transformer.enums

    from ...snapshot import register_safe_class

    register_safe_class(argparse.Namespace, *{type(v) for v in vars(args).values() if isinstance(v, enum.Enum)})
    for module in (megatron.core.enums, megatron.core.transformer.enums, megatron.core.rerun_state_machine):
        register_safe_class(*(v for v in vars(module).values()
                              if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__))


def allow_local_tasd() -> None:
    """MCoreTensorAwareStateDict.from_state_dict refuses to run without nvidia-resiliency-ext, whose only
    use there is the base class; it does not install next to 0.19.2 on Python 3.11 (MEGATRON.md)."""
    from megatron.core.dist_checkpointing import tensor_aware_state_dict

    tensor_aware_state_dict.HAVE_NVRX = True


def around_setup(before, after) -> None:
    """pretrain() builds nvrx's manager itself (only when the cfg asks for 'local' checkpoints) and calls
    load_checkpoint inside setup_model_and_optimizer: `before(checkpointing_context)` puts ours in place
    just ahead of that, `after(model, optimizer)` runs once the load is done."""
    from megatron.training import training

    setup = training.setup_model_and_optimizer

    @functools.wraps(setup)
    def wrapped(*args, checkpointing_context=None, **kwargs):
        if checkpointing_context is not None:
            before(checkpointing_context)
        model, optimizer, scheduler = setup(*args, checkpointing_context=checkpointing_context, **kwargs)
        after(model, optimizer)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = wrapped


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


def unshare_adam_steps(optimizer) -> None:
    """0.19.2's DistributedOptimizer.load_state_dict (without Apex/TE) gives every parameter's Adam state the
    same `step` tensor, which torch's Adam then increments once per parameter each step: the bias correction
    silently drifts. Give each parameter its own copy, as a fresh optimizer has."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if "step" in state and hasattr(state["step"], "clone"):
                state["step"] = state["step"].clone()
