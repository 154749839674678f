"""A pipeline snapshot (a DeepSpeed PipelineModule's, ZeRO-1, any number of stages) as a universal checkpoint, laid out as stock
`ds_to_universal` lays out a pipeline checkpoint:

    <out>/<tag>/zero/<DeepSpeed's parameter name>/...   as universal_export.py: `3.qkv.weight`, and a tied
                                                        parameter once, `tied_modules.<key>.weight`
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

from ...errors import InmemFTError
from .universal_export import rank_plan
from ...universal.source import MemorySource


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


def plan(src: MemorySource) -> tuple[str, dict[str, dict], dict, list[tuple[str, str, tuple, object]]]:
    """universal_export.plan for a pipeline snapshot: every stage's parameters once (a tied one from the first stage
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
