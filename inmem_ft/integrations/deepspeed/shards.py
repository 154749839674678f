"""Shard specs for the dicts DeepSpeed hands its checkpoint engine: where each stored element sits in the model.

Derived only from what DeepSpeed saves (`param_shapes`, `param_slice_mappings`, paddings, partition counts,
the ZeRO-3 partition rule of `ds_to_universal`), so a loader can rebuild any parameter or optimizer moment
from any layout. Keys: the parameter's name for model weights, `optimizer.state.<fp32_param|exp_avg|
exp_avg_sq>.<name>` for the optimizer (Megatron's naming, so both frameworks share one key space).

Containers are copied along every path that gets a spec: `optimizer.state_dict()` hands out the optimizer's
live per-parameter state dicts, which must not be touched.
"""
from __future__ import annotations

import math

from ...errors import InmemFTError
from ...snapshot import Sharded, ShardSpec, annotate
from ...snapshot.annotate import optimizer_key

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat_pieces(kind: str, pieces: list[tuple[str, tuple, int, int, int]]) -> list[ShardSpec]:
    """(name, shape, at, lo, hi) -> specs: elements [lo, hi) of each parameter, at `at` in a flat buffer."""
    return [ShardSpec(optimizer_key(kind, name), tuple(shape), flat=(lo, hi), at=at)
            for name, shape, at, lo, hi in pieces if hi > lo]


def zero12_pieces(shapes: dict, mapping: dict, partition_len: int, padding: int, dp_rank: int, where: str):
    """This rank's piece of each parameter in its ZeRO-1/2 flat partition of one param group.

    The group's parameters lie end to end in `param_shapes` order and the flat buffer is split into equal
    partitions, rank d holding [d*P, (d+1)*P) (the last one's tail padding stripped). DeepSpeed records
    where each piece starts in the partition (`param_slice_mappings`); the offset inside the parameter
    follows from the cumulative sizes, and the two must agree, or this is a layout we do not understand.
    """
    size = partition_len + padding
    base, start, pieces = dp_rank * size, 0, []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        lo, hi = max(start, base), min(start + numel, base + size)
        if hi > lo:
            frag = mapping.get(name)
            if frag is None or frag.start != lo - base or frag.numel != hi - lo:
                raise InmemFTError(
                    f"{where}: parameter {name} should sit at [{lo - base}, {hi - base}) of DP rank {dp_rank}'s "
                    f"partition but DeepSpeed maps it to {frag}; this ZeRO layout (round-robin gradients or "
                    f"parameter alignment padding?) is not supported by inmem_ft's shard map")
            pieces.append((name, tuple(shape), lo - base, lo - start, hi - start))
        start += numel
    return pieces


def zero3_pieces(shapes: dict, dp_rank: int, dp_size: int):
    """ZeRO-3: every parameter is split on its own, ceil(numel/dp) elements a rank (ds_to_universal's rule)."""
    at, pieces = 0, []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = -(-numel // dp_size)
        lo = min(numel, dp_rank * part)
        hi = min(numel, lo + part)
        pieces.append((name, tuple(shape), at, lo, hi))
        at += part
    return pieces


def _moments(state: dict, pieces, wrap) -> dict:
    out = dict(state)
    for kind in MOMENTS:
        if kind in out:
            out[kind] = wrap(out[kind], kind, pieces)
    return out


def with_specs(files: dict, *, zero_stage: int, dp_rank: int, dp_size: int, param_names: dict,
               partition_ranks: list[int] | None = None) -> dict:
    """A copy of `files` ({file name: state dict}) whose tensors carry shard specs.

    param_names: ZeRO-0 only, optimizer param index -> parameter name (its state is keyed by index).
    partition_ranks: ZeRO-1/2, this rank's partition in each param group where a group is not partitioned over
    the whole data-parallel group (MoE expert groups: moe.Experts.partition_ranks); default dp_rank for all."""
    def flat(t, kind, pieces):
        return Sharded(t, _flat_pieces(kind, pieces))

    out = {}
    for fname, sd in files.items():
        sd = dict(sd)
        if fname.endswith("model_states.pt"):
            module = sd.get("module")
            if module is not None and zero_stage < 3:  # ZeRO-3's module holds empty placeholders
                sd["module"] = annotate.state_dict(module)
            if zero_stage == 0 and sd.get("optimizer") is not None:
                sd["optimizer"] = _zero0_optimizer(sd["optimizer"], param_names)
        elif fname.endswith("optim_states.pt"):
            osd = dict(sd["optimizer_state_dict"])
            shapes = files_param_shapes(files)
            if zero_stage in (1, 2):
                base = dict(osd["base_optimizer_state"])
                state = dict(base["state"])
                fp32 = list(osd["single_partition_of_fp32_groups"])
                for g, group_shapes in enumerate(shapes):
                    pieces = zero12_pieces(group_shapes, osd["param_slice_mappings"][g], fp32[g].numel(),
                                           osd["group_paddings"][g],
                                           dp_rank if partition_ranks is None else partition_ranks[g], fname)
                    fp32[g] = flat(fp32[g], "fp32_param", pieces)
                    state[g] = _moments(state[g], pieces, flat)
                base["state"] = state
                osd["base_optimizer_state"], osd["single_partition_of_fp32_groups"] = base, fp32
            elif zero_stage == 3:
                inner = dict(osd["optimizer_state_dict"])
                state = dict(inner["state"])
                fp32 = list(osd["fp32_flat_groups"])
                for g, group_shapes in enumerate(shapes):
                    pieces = zero3_pieces(group_shapes, dp_rank, dp_size)
                    fp32[g] = flat(fp32[g], "fp32_param", pieces)
                    state[g] = _moments(state[g], pieces, flat)
                inner["state"] = state
                osd["optimizer_state_dict"], osd["fp32_flat_groups"] = inner, fp32
            sd["optimizer_state_dict"] = osd
        out[fname] = sd
    return out


def files_param_shapes(files: dict) -> list[dict]:
    for fname, sd in files.items():
        if fname.endswith("model_states.pt") and sd.get("param_shapes") is not None:
            shapes = sd["param_shapes"]
            return shapes if isinstance(shapes, list) else [shapes]
    raise InmemFTError("DeepSpeed handed over no model-states dict with param_shapes; cannot map ZeRO partitions")


def _zero0_optimizer(opt: dict, param_names: dict) -> dict:
    """ZeRO-0 keeps whole tensors keyed by parameter index: the torch optimizer's state_dict, or (bf16,
    FP16_UnfusedOptimizer) that nested under `optimizer_state_dict` beside `fp32_groups`, whose flattened
    order is the same parameter index."""
    if "optimizer_state_dict" not in opt:
        return annotate.optimizer_state(opt, param_names)
    opt = dict(opt)
    opt["optimizer_state_dict"] = annotate.optimizer_state(opt["optimizer_state_dict"], param_names)
    if "fp32_groups" in opt:
        index, groups = 0, []
        for group in opt["fp32_groups"]:
            groups.append([annotate.whole(optimizer_key("fp32_param", param_names[index + i]), t)
                           for i, t in enumerate(group)])
            index += len(group)
        opt["fp32_groups"] = groups
    return opt


def rekey_specs(tree, rekeyed):
    """Apply `rekeyed` (spec -> spec) to every shard spec in `tree` (with_specs' output, whose Sharded wrappers
    are its own), in place: the pipeline and MoE adapters move specs from module names to their own keys."""
    if isinstance(tree, Sharded):
        tree.specs = tuple(rekeyed(s) for s in tree.specs)
    elif isinstance(tree, dict):
        for value in tree.values():
            rekey_specs(value, rekeyed)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            rekey_specs(value, rekeyed)
    return tree
