"""A Megatron snapshot as the checkpoint Megatron's `--load` reads through dist_checkpointing (torch_dist).

    <out>/latest_checkpointed_iteration.txt     the iteration
    <out>/iter_XXXXXXX/metadata.json            {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    <out>/iter_XXXXXXX/.metadata                torch.distributed.checkpoint metadata
    <out>/iter_XXXXXXX/__0_<n>.distcp           one file per global tensor or object
    <out>/iter_XXXXXXX/common.pt                the common state, for megatron-core 0.17 and 0.18

What megatron-core's `dist_checkpointing.save` writes: every ShardedTensor key as one global tensor
(its `global_shape`, prepended layer axes included), every ShardedObject as the bytes of `torch.save([data])`
under its `unique_key` (`<key>/shard_<offset>_<shape>`), and the common state (args, iteration, scheduler,
optimizer param groups, content metadata) as the ShardedObject `common_state` (0.19) or in `common.pt` (0.17 and
0.18: integrations/megatron/versions.py), as the release that took the snapshot writes it.
Megatron's load then cuts the boxes its own layout needs from the global tensors, so another TP/PP layout
loads it too.

Global tensors are read from memory when torch's writer asks for each (dcp.FromMemory) and written at once:
one global tensor at a time in memory.
"""
from __future__ import annotations

import io
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ...errors import InmemFTError
from ...persist.atomic import atomic_write_text
from ...snapshot.catalog import coverage
from ...snapshot.tree import dtype_from_name
from ...dcp.export import FromMemory
from ...universal.source import MemorySource

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", ..., (1,), (0,)).unique_key


def iteration_dir(out: str, iteration: int) -> str:
    return os.path.join(out, f"iter_{iteration:07d}")


def unique_key(obj: dict) -> str:
    return f"{obj['key']}/shard_{'.'.join(map(str, obj['global_offset']))}_{'.'.join(map(str, obj['global_shape']))}"


def content_metadata(args) -> dict:
    """What Megatron's save_checkpoint passes as `content_metadata` (checkpointing.py,
    _build_sharded_state_dict_metadata, 0.19.2) and its load reads to pick the optimizer's sharding type; the
    local checkpoints a snapshot comes from carry none, so it is rebuilt from the run's args."""
    meta = {}
    if getattr(args, "use_distributed_optimizer", False):
        if getattr(args, "dist_ckpt_optim_fully_reshardable", False):
            meta["distrib_optim_sharding_type"] = "fully_reshardable"
            meta["distrib_optim_fully_reshardable_mem_efficient"] = args.distrib_optim_fully_reshardable_mem_efficient
        else:
            meta["distrib_optim_sharding_type"] = "dp_reshardable"
    meta["singleton_local_shards"] = False
    meta["chained_optim_avoid_prefix"] = True
    return meta


def plan(src: MemorySource) -> tuple[int, dict, dict, dict]:
    """(iteration, common state, {unique key: object}, {key: meta tensor}), checked before anything is written."""
    topo = src.topology
    if topo.get("framework") != "megatron":
        raise InmemFTError(f"--format megatron-dist needs a Megatron snapshot; step {src.step} was taken by "
                           f"{topo.get('framework')!r}: export it with --format deepspeed-universal or torch-dcp")
    from .manager import replica_tuple, tensor_entries
    from .patch import register_safe_classes  # imports megatron: only for this format

    register_safe_classes()  # the common state's Namespace and enums come back as themselves
    common = src.state(0, "common")
    common.setdefault("content_metadata", content_metadata(common["args"]))
    objects, keys = {}, set()
    for rank in sorted(src.manifests):
        keys.update(t["key"] for t in tensor_entries(src.state(rank, "tensors")))
        for obj in src.state(rank, "objects"):
            if not any(replica_tuple(obj["replica_id"])) or unique_key(obj) not in objects:  # the main copy wins
                objects[unique_key(obj)] = obj["data"]
    found = {c["key"]: c for c in coverage(src.table) if c["key"] in keys}
    problems = [f"{k}: not in the catalog" for k in sorted(keys - set(found))]
    problems += [f"{k}: {c['hole']}" for k, c in sorted(found.items()) if c["hole"]]
    if problems:
        raise InmemFTError(f"step {src.step}'s global tensors do not cover what Megatron saved ("
                           f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}): Megatron's load needs "
                           f"each whole; `inmem-ft inspect --step {src.step}` shows what is missing")
    tensors = {k: torch.empty(c["global_shape"], dtype=dtype_from_name(c["dtype"]), device="meta")
               for k, c in found.items()}
    return int(common.get("iteration", src.step)), common, objects, tensors


class _Prepickled(FromMemory):
    """Objects arrive as the bytes Megatron's torch_dist strategy writes; torch's planner would pickle them
    once more (Megatron's MCoreSavePlanner passes them through the same way)."""

    def transform_object(self, write_item, object):
        return object


def _pickled(value) -> io.BytesIO:
    """A ShardedObject's bytes as Megatron's torch_dist strategy writes them (a list of the rank's pieces)."""
    buf = io.BytesIO()
    torch.save([value], buf)
    buf.seek(0)
    return buf


def write(src: MemorySource, out: str, bar) -> tuple[str, int, int]:
    """Writes the checkpoint under `out`, one global tensor at a time (`bar`: a tqdm); returns (the iteration
    directory, tensors, bytes)."""
    from . import versions

    iteration, common, objects, tensors = plan(src)
    it_dir = iteration_dir(out, iteration)
    if os.path.exists(it_dir):
        raise InmemFTError(f"{it_dir} already exists; remove it or give another --out")
    bar.reset(total=len(tensors))
    common_file = versions.common_state_file(src.topology["framework_version"])  # the release that took it
    state: dict = {**tensors, **{k: _pickled(v) for k, v in objects.items()}}
    if common_file is None:
        state[COMMON_KEY] = _pickled(common)
    else:
        os.makedirs(it_dir)
        torch.save(common, os.path.join(it_dir, common_file))
    planner = _Prepickled(src, bar)
    # One file per item (see dcp.py: torch's writer holds every tensor of a file until the file is done).
    dcp.save(state, storage_writer=FileSystemWriter(it_dir, single_file_per_rank=False, thread_count=1),
             planner=planner)
    # Megatron writes metadata.json last (its finalize step) and the tracker after that: a reader never sees
    # an iteration whose files are still being written.
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        json.dump(CONFIG, f)
    atomic_write_text(os.path.join(out, TRACKER), str(iteration))
    return it_dir, len(tensors), planner.nbytes
