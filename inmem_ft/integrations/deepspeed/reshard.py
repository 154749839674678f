"""A snapshot of another ZeRO stage or DP size, put into a live ZeRO-1/2/3 engine (universal/reshard.py finds
and reads it, from the slots the SMPs hold: in memory, or adopted from their disk tier). Translation only:
which flat range of each parameter this rank holds, and DeepSpeed's public API to put values there
(`deepspeed.utils.safe_set_*`), as DeepSpeed's own universal-checkpoint load does.

Where that API stops short (DeepSpeed 0.19.8, checked on CPU):
- a fresh engine has no optimizer state (Adam creates it at the first step, and ZeRO-1/2 link their
  parameter fragments to it only then): the state is created here as torch's Adam creates it (zeros and a
  `step`), and ZeRO-1/2 link it with DeepSpeed's exported `lazy_init_hp_params_optimizer_state`;
- ZeRO-3's `safe_set_full_*` cut the full value at `partition_numel * rank`, which overruns the tensor on
  the last rank when DP does not divide the parameter: the local API (`safe_set_local_*`, one padded
  partition) is used instead, and also sets only what the rank holds;
- the module weights follow the fp32 masters as after every optimizer step: ZeRO-1/2 through the
  optimizer's `update_lp_params()` (what DeepSpeed calls after a universal load), ZeRO-3 by copying each
  rank's partition into `param.ds_tensor` between `checkpoint_event_prologue/epilogue` (which re-gather
  the parameters ZeRO-3 keeps whole).
"""
from __future__ import annotations

import math
import time

import torch

from ...capture import restore_rng_state
from ...errors import ConfigError, InmemFTError
from ...universal.reshard import Resharding
from . import stock

FP32 = "fp32_param"


class ModuleKeys:
    """How a plain engine's parameters are named in the shard map: by their module names, all on every rank.
    (A pipeline engine's: pipeline.Pipeline.)"""

    @staticmethod
    def key_of(name: str) -> str:
        return name

    @staticmethod
    def held_elsewhere(key: str) -> bool:
        return False


class WholeBoxes:
    """Where a plain engine's parameters sit in the global tensors: each is the whole of one. (Tensor-parallel
    slices: tensor_parallel.TensorParallel.)"""

    @staticmethod
    def box(key: str, shape: tuple) -> tuple[tuple, tuple]:
        return tuple(shape), (0,) * len(shape)


def load(engine, rs: Resharding, agree_min, keys=ModuleKeys, boxes=None) -> dict:
    """Collective: every rank's engine gets the snapshot's parameters, optimizer state, step, scheduler and
    counters, and this rank its RNG; returns {extras, seconds per phase}. `agree_min(value)`: the smallest of
    every rank's, on the snapshot's own gloo group (Snapshotter.agree_min: the default group may be NCCL, which
    takes no host tensor); `keys`: how this engine's parameters are named in the shard map (key_of) and which
    parameters of the snapshot other ranks' models hold (held_elsewhere); `boxes`: which box of its global
    tensor each parameter is here (box; default whole)."""
    t0 = time.perf_counter()
    stage = int(engine.zero_optimization_stage())
    ok, error = 1, None
    try:  # every rank must hear of a failure before the collectives below, or they would wait forever
        params = _plan(engine, rs, stage, keys, boxes or WholeBoxes)
        model, _, inner = stock.model_and_optimizer(rs.job_state("files"), f"step {rs.step} of the old layout")
        if len(inner["param_groups"]) != len(engine.optimizer.param_groups):
            raise InmemFTError(f"the old layout's optimizer has {len(inner['param_groups'])} param groups, this "
                               f"one {len(engine.optimizer.param_groups)}: restart the job with the optimizer it was "
                               f"taken with")
        _fill(engine, rs, stage, params, _step(inner))
        _buffers(engine, rs, model)
        own = rs.rank_state("rank")
    except Exception as e:
        ok, error = 0, e
    t1 = time.perf_counter()
    if not agree_min(ok):
        raise error or InmemFTError(f"another rank failed to read its share of step {rs.step} of the old layout "
                                    f"(its log says why)")
    if stage == 3:
        engine.optimizer.checkpoint_event_epilogue()
    else:
        engine.optimizer.update_lp_params()
    for group, saved in zip(engine.optimizer.param_groups, inner["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if engine.lr_scheduler is not None and model.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
    position = rs.old.position or {}
    engine.global_steps = int(position.get("global_steps", model["global_steps"]))
    engine.global_samples = int(position.get("global_samples", model["global_samples"]))
    engine.skipped_steps = int(model.get("skipped_steps", 0))
    restore_rng_state(own["rng"])
    return {"extras": own["extras"],
            "seconds": {"read_set": round(t1 - t0, 4), "engine": round(time.perf_counter() - t1, 4)}}


def check_target(engine) -> None:
    """What a reshard can load into; raises ConfigError saying what to do otherwise."""
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        raise ConfigError(f"inmem_ft: resharding loads into ZeRO-1/2/3 engines, this one is ZeRO-{stage}: run the "
                          f"job with ZeRO-1, 2 or 3, or with the snapshot's original layout")
    if engine.fp16_enabled():
        raise ConfigError("inmem_ft: resharding into an fp16 (loss-scaled) engine is not supported; use bf16 or "
                          "fp32, or the snapshot's original layout")


def _plan(engine, rs: Resharding, stage: int, names, boxes) -> list[tuple[str, torch.nn.Parameter, dict[str, str],
                                                                         tuple]]:
    """(name, parameter, {kind: key}, (offset, shape) of its box in the global tensor) per parameter, checked
    against the snapshot before anything changes."""
    keys = rs.optimizer_keys()
    if not keys:
        raise InmemFTError(f"step {rs.step} of the old layout holds no optimizer state (taken before the first "
                           f"optimizer step?): nothing to reshard from; restore a later step")
    out, problems = [], []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            raise InmemFTError(f"{name} is frozen (requires_grad=False): resharding covers trained parameters "
                               f"only; restart with the snapshot's original layout")
        key = names.key_of(name)
        kinds = keys.pop(key, {})
        local = tuple(p.ds_shape) if stage == 3 else tuple(p.shape)
        shape, offset = boxes.box(key, local)
        if FP32 not in kinds:
            problems.append(f"{name}: no fp32 master weight in the snapshot")
            continue
        got = rs.source.fragments.shape(kinds[FP32])
        if got != shape:
            problems.append(f"{name}: shape {shape} here, {got} in the snapshot")
        problems += [f"{key}: {rs.source.fragments.dtype(key)} in the snapshot, not float32" for key in kinds.values()
                     if rs.source.fragments.dtype(key) != torch.float32]
        out.append((name, p, kinds, (offset, local)))
    problems += [f"{name}: in the snapshot, not in this model" for name in sorted(keys)
                 if not names.held_elsewhere(name)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InmemFTError(f"the snapshot of step {rs.step} ({rs.old.layout()}) is not of this model: "
                           f"{'; '.join(problems[:3])}{more}; restart the job with the model it was taken from")
    return out


def _buffers(engine, rs: Resharding, model: dict) -> None:
    """The module's buffers (state-dict entries that are no parameter) from the old layout's module state:
    whole in rank 0's model states, or (ZeRO-1/2 snapshots annotate them) read from the catalog."""
    params = {name for name, _ in engine.module.named_parameters(remove_duplicate=False)}
    persistent = set(engine.module.state_dict(keep_vars=True)) - params  # non-persistent buffers are not saved
    saved = model.get("module") or {}
    for name, buf in engine.module.named_buffers(remove_duplicate=False):
        if name not in persistent:
            continue
        if name not in saved:
            raise InmemFTError(f"buffer {name} is not in the snapshot of step {rs.step}: restart the job with the "
                               f"model it was taken from")
        value = saved[name] if saved[name] is not None else rs.source.tensor(name)
        buf.data.copy_(value)


def _step(inner: dict):
    """The optimizer step every param group of the old layout shares (DeepSpeed steps them together)."""
    steps = {float(s["step"]) for s in inner["state"].values() if "step" in s}
    if len(steps) != 1:
        raise InmemFTError(f"the old layout's optimizer groups are at steps {sorted(steps)}; resharding needs one "
                           f"step for all of them")
    return next(s["step"] for s in inner["state"].values() if "step" in s)


def _fill(engine, rs: Resharding, stage: int, params, step) -> None:
    """This rank's ranges of every parameter's master weight and optimizer state, read and set."""
    from deepspeed.utils import (lazy_init_hp_params_optimizer_state, safe_set_full_fp32_param,
                                 safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    opt = engine.optimizer
    kinds = sorted({kind for _, _, k, _ in params for kind in k} - {FP32})
    flats = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    for flat in flats:
        state = opt.optimizer.state[flat]  # torch's Adam state, created as its first step would
        state["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        for kind in kinds:
            state.setdefault(kind, torch.zeros_like(flat))
    if stage == 3:
        opt.checkpoint_event_prologue()
    else:
        for lp, flat in zip(opt.bit16_groups, flats):
            lazy_init_hp_params_optimizer_state(lp, flat, opt.optimizer.state)
    # One scratch tensor for every piece: fresh pages fault once, not once per piece (several times the copy
    # on a loaded box), and memory stays at the largest parameter beyond the engine's own state.
    scratch = torch.empty(max(p.partition_numel() if stage == 3 else p.numel() for _, p, _, _ in params))
    for name, p, keys, (offset, shape) in params:
        if stage == 3:
            part = p.partition_numel()
            lo, hi = _zero3_range(name, p, part, opt.dp_process_group)
            local = scratch[:part]
            local[hi - lo:] = 0  # the last partition's padding, as ZeRO-3 keeps it
            for kind, key in sorted(keys.items()):
                rs.source.piece(key, offset, shape, flat=(lo, hi), out=local[: hi - lo])
                if kind == FP32:
                    safe_set_local_fp32_param(p, local)
                    p.ds_tensor.data.copy_(local)
                else:
                    safe_set_local_optimizer_state(p, local, kind)
            continue
        if p._hp_mapping is None:  # this rank's partition holds none of it
            continue
        where = p._hp_mapping.lp_fragment_address
        lo, hi = where.start, where.start + where.numel
        full = scratch[: p.numel()]  # only [lo, hi) is read into, and only that is set
        for kind, key in sorted(keys.items()):
            rs.source.piece(key, offset, shape, flat=(lo, hi), out=full[lo:hi])
            if kind == FP32:
                safe_set_full_fp32_param(p, full.view(p.shape))
            else:
                safe_set_full_optimizer_state(p, full.view(p.shape), kind)


def _zero3_range(name: str, p, part: int, dp_group) -> tuple[int, int]:
    """[lo, hi) of the parameter's flat elements in this rank's ZeRO-3 partition (ds_to_universal's rule)."""
    import deepspeed.comm as dist

    group = getattr(p, "ds_process_group", dp_group)  # where ZeRO-3 itself looks
    numel, ranks = p.ds_numel, dist.get_world_size(group=group)
    if part != math.ceil(numel / ranks):
        raise InmemFTError(f"{name}: ZeRO-3 partitions it into {part} elements per rank, not ceil({numel}/{ranks}); "
                           f"this partitioning (hpZ, MiCS?) is not supported by resharding")
    lo = min(numel, dist.get_rank(group=group) * part)
    return lo, min(numel, lo + part)
