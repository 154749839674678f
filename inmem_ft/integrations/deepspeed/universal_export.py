"""A snapshot as the universal checkpoint DeepSpeed's `ds_to_universal` writes, built from memory.

    <out>/latest_universal                      the tag
    <out>/<tag>/zero/<param>/fp32.pt            {'param': full fp32 master weight, 'cat_dim': its
                                                tensor-parallel dim (0 if not split)}
    <out>/<tag>/zero/<param>/exp_avg.pt         the same for each Adam moment
    <out>/<tag>/zero/<param>/step.pt            the optimizer step of the parameter's group
    <out>/<tag>/zero/optimizer_state.pt         the optimizer's non-tensor state and param_groups
    <out>/<tag>/mp_rank_00_model_states.pt      the engine's model states (lr scheduler, steps, config)
    <out>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same file under ZeRO-3's name

Stock DeepSpeed with `"checkpoint": {"load_universal": true}` loads it at ZeRO-1, 2 and 3 on any DP size.
Two things stock ds_to_universal output lacks for a ZeRO-3 loader (shared/MEGATRON.md, section 2) are
added: the model states under the ZeRO-3 file name, and `optimizer_state_dict` (where the stage-3 loader
reads the step) in optimizer_state.pt.

Global tensors are read and written one at a time. The model states keep everything DeepSpeed saved except
`module`: a universal load takes the weights from zero/ and never reads it, and writing it would hold the
whole model at once.

A pipeline snapshot (a DeepSpeed PipelineModule's, ZeRO-1, any number of stages) is laid out as stock
`ds_to_universal` lays out a pipeline checkpoint:

    <out>/<tag>/zero/<DeepSpeed's parameter name>/...   as above: `3.qkv.weight`, and a tied parameter once,
                                                        `tied_modules.<key>.weight`
    <out>/<tag>/mp_rank_<NN>_model_states.pt            the model states (param_shapes, steps, lr scheduler) of
                                                        stage S's tensor-parallel rank T, NN = S * tp + T (the
                                                        model-parallel rank DeepSpeed reads it by)

DeepSpeed names a PipelineModule's parameters by the layer's global index (or the tied key), whichever stage
holds the layer, and a universal load reads the weights and optimizer state from zero/ only (never the
`layer_XX-model_states.pt` files): stock DeepSpeed 0.19 loads this export into the same PipelineModule built
with any number of stages and any data-parallel size (ZeRO-1). Each stage's DP rank 0 gives its
model states and optimizer hyperparameters; the snapshot's tensors, keyed `layer_XX.<name>`, are found from
DeepSpeed's names through the names each rank recorded (`pipeline.names` in its snapshot).
"""
from __future__ import annotations

import os

import torch

from ...errors import InmemFTError
from ...universal.source import MemorySource

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# Per-rank pieces of the ZeRO-1/2 and ZeRO-3 optimizer files; zero/<param>/ holds them whole.
PARTITIONED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups",
               "fp32_flat_groups", "optimizer_state_dict")
FILES = (("fp32_param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
# What ds_to_universal --inject_missing_state adds for clients other than Megatron.
UNIVERSAL_INFO = {"universal_checkpoint_version": 0.4}


def plan(src: MemorySource) -> tuple[str, dict[str, dict], dict, list[tuple[str, str, tuple, object]]]:
    """(tag, {model-states file name: its dict}, optimizer_state.pt, [(zero/ directory, snapshot key, shape, step
    of its param group)]), checked first so that nothing is written for a snapshot this exporter cannot
    represent."""
    topo = src.topology
    if topo.get("framework") != "deepspeed":
        raise InmemFTError(f"--format deepspeed-universal needs a DeepSpeed snapshot; step {src.step} was taken "
                           f"by {topo.get('framework')!r}: export it with --format megatron-dist or torch-dcp")
    if topo.get("zero_stage") not in (1, 2, 3):
        raise InmemFTError(f"--format deepspeed-universal covers ZeRO-1/2/3; this snapshot is "
                           f"ZeRO-{topo.get('zero_stage')} tp{topo.get('tp')} pp{topo.get('pp')}: "
                           f"export it with --format torch-dcp")
    from . import types  # imports deepspeed: only for this format

    types.register()  # DeepSpeed's loss scaler and enums come back as themselves, as DeepSpeed saved them
    if topo.get("pp", 1) > 1 or recorded_names(src, 0) is not None:  # PipelineModule
        return pipeline_plan(src)
    if topo.get("tp", 1) > 1:
        raise InmemFTError(f"--format deepspeed-universal covers tensor parallelism only in a PipelineModule; "
                           f"this snapshot is tp{topo.get('tp')} without one: export it with --format torch-dcp")
    model, common, groups = rank_plan(src, 0)
    params = [(name, name, shape, step) for group, step in groups for name, shape in group.items()]
    # fix 1: the ZeRO-3 engine globs zero_pp_rank_0_mp_rank_*_model_states.pt
    return str(src.state(0, "tag")), {name: model for name in MODEL_STATES}, common, params


def rank_plan(src: MemorySource, rank: int) -> tuple[dict, dict, list[tuple[dict, object]]]:
    """(model states, optimizer_state.pt, [({DeepSpeed's parameter name: shape}, step)] per param group) from
    `rank`'s DeepSpeed files."""
    from . import stock

    model, osd, inner = stock.model_and_optimizer(src.state(rank, "files"),
                                                  f"rank {rank}'s snapshot of step {src.step}")
    if model.get("num_experts"):  # what DeepSpeed saves for deepspeed.moe.layer.MoE layers
        raise InmemFTError(f"--format deepspeed-universal cannot represent step {src.step}'s mixture-of-experts "
                           f"layers: stock DeepSpeed's universal checkpoint places experts only for AutoEP layers "
                           f"(deepspeed.moe.layer.MoE experts would load by their local index); export it with "
                           f"--format torch-dcp")
    shapes = model["param_shapes"]
    shapes = shapes if isinstance(shapes, list) else [shapes]
    missing = [g for g in range(len(shapes)) if "step" not in inner["state"].get(g, {})]
    if missing:
        raise InmemFTError(f"rank {rank}'s snapshot of step {src.step} holds no Adam state for param groups "
                           f"{missing} (taken before the first optimizer step?); export a later step")
    groups = [(group, inner["state"][g]["step"]) for g, group in enumerate(shapes)]

    common = {k: v for k, v in osd.items() if k not in PARTITIONED}
    common["param_groups"] = inner["param_groups"]
    common.setdefault("ds_version", model.get("ds_version"))  # the ZeRO-1/2 loader asserts on it
    # Fix 2: the ZeRO-3 loader reads the step and param_groups from here.
    common["optimizer_state_dict"] = {"state": {g: {"step": step} for g, (_, step) in enumerate(groups)},
                                      "param_groups": inner["param_groups"]}
    model = {**model, "module": {}}
    model.setdefault("universal_checkpoint_info", UNIVERSAL_INFO)
    return model, common, groups


def model_parallel_ranks(src: MemorySource) -> dict[tuple[int, int], int]:
    """(pipeline stage, tensor-parallel rank) -> the rank at data-parallel coordinate 0 of it."""
    out: dict[tuple[int, int], int] = {}
    for rank in sorted(src.manifests):
        coords = src.topology_of(rank).get("coords", {})
        if coords.get("dp", 0) == 0:
            out.setdefault((coords.get("pp", 0), coords.get("tp", 0)), rank)
    pp, tp = src.topology.get("pp", 1), src.topology.get("tp", 1)
    want = [(s, t) for s in range(max(pp, 1)) for t in range(tp)]
    if sorted(out) != want:
        raise InmemFTError(f"step {src.step}'s topology records name (stage, tensor-parallel rank) {sorted(out)} at "
                           f"data-parallel rank 0, not all {want}: not a snapshot this exporter understands")
    return out


def recorded_names(src: MemorySource, rank: int) -> dict[str, str] | None:
    """DeepSpeed's parameter name -> snapshot key, as `rank` recorded them (None: no pipeline snapshot, or one
    taken by an inmem_ft that did not record them)."""
    try:
        return src.state(rank, "pipeline", "names")
    except InmemFTError:
        return None


def pipeline_plan(src: MemorySource) -> tuple[str, dict[str, dict], dict, list[tuple[str, str, tuple, object]]]:
    """plan() for a pipeline snapshot: every stage's parameters once (a tied one from the first stage
    that holds it; the shapes tensor-parallel rank 0 holds), every model-parallel rank's model states; the
    optimizer's common state from stage 0."""
    models, params, seen, common = {}, [], set(), None
    tp = src.topology.get("tp", 1)
    for (stage, tp_rank), rank in sorted(model_parallel_ranks(src).items()):
        model, stage_common, groups = rank_plan(src, rank)
        models[f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"] = model
        if tp_rank:  # its parameters are the same global tensors as TP rank 0's
            continue
        keys = recorded_names(src, rank)
        if keys is None:
            raise InmemFTError(f"rank {rank}'s snapshot of step {src.step} does not record its pipeline parameter "
                               f"names (taken by an older inmem_ft): export a step taken since, or use --format "
                               f"torch-dcp")
        common = common or stage_common
        for group, step in groups:
            for name, shape in group.items():
                if name not in seen:
                    seen.add(name)
                    params.append((name, keys[name], shape, step))
    return str(src.state(0, "tag")), models, common, params


def partition_dim(src: MemorySource, key: str) -> int | None:
    """The one dim along which `key`'s main fragments split it across tensor-parallel ranks (None: whole)."""
    cols = src.fragments.cols
    dims = {d for i in src.fragments.by_key[key]
            for d, (box, full) in enumerate(zip(cols["shape"][i], cols["global_shape"][i])) if box != full}
    if len(dims) > 1:
        raise InmemFTError(f"{key} is split along dims {sorted(dims)}; --format deepspeed-universal takes one "
                           f"tensor-parallel dim per parameter: export it with --format torch-dcp")
    return dims.pop() if dims else None


def write(src: MemorySource, out: str, bar) -> tuple[str, int, int]:
    """Writes the checkpoint under `out`, one tensor at a time (`bar`: a tqdm); returns (the tag directory,
    tensors, bytes)."""
    tag, models, common, params = plan(src)
    tag_dir = os.path.join(out, tag)
    if os.path.exists(tag_dir):
        raise InmemFTError(f"{tag_dir} already exists; remove it or give another --out")
    bar.reset(total=len(params) * len(FILES))
    tensors = nbytes = 0
    zero = os.path.join(tag_dir, "zero")
    for name, key, shape, step in params:
        pdir = os.path.join(zero, name)
        os.makedirs(pdir)
        for kind, fname in FILES:
            skey = f"optimizer.state.{kind}.{key}"
            t, dim = src.tensor(skey), partition_dim(src, skey) if src.topology.get("tp", 1) > 1 else None
            if [n for d, n in enumerate(t.shape) if d != dim] != [n for d, n in enumerate(shape) if d != dim]:
                raise InmemFTError(f"{kind} of {name}: the catalog's global shape {tuple(t.shape)} is not "
                                   f"DeepSpeed's param_shapes {tuple(shape)}"
                                   f"{'' if dim is None else f' outside its tensor-parallel dim {dim}'}")
            # DeepSpeed cuts `param` along cat_dim for each tensor-parallel rank (whole where the shapes match)
            torch.save({"param": t, "cat_dim": dim or 0}, os.path.join(pdir, f"{fname}.pt"))
            tensors, nbytes = tensors + 1, nbytes + t.numel() * t.element_size()
            bar.update(1)
            del t  # before the next one is read
        torch.save(step, os.path.join(pdir, "step.pt"))
    torch.save(common, os.path.join(zero, "optimizer_state.pt"))
    for name, model in models.items():
        torch.save(model, os.path.join(tag_dir, name))
    with open(os.path.join(out, "latest_universal"), "w") as f:
        f.write(tag)
    return tag_dir, tensors, nbytes
