"""The object Megatron finds in `checkpointing_context['local_checkpoint_manager']`.

Megatron builds the tensor-aware state dict (TASD) and decides when to save and what to load; this class
only translates (megatron.training.checkpointing, 0.19.2, MEGATRON.md section 1):

- save(tasd, iteration, is_async): every ShardedTensor this rank holds becomes a tensor with its shard spec,
  every ShardedObject a plain value; Snapshotter.save copies them behind the next forward/backward. With
  the 'fully_parallel' algorithm Megatron has already set `data=None` on all data-parallel replicas of a
  shard but one, so a replicated shard is stored once across data-parallel ranks.
- find_latest() and load(), each called twice per load_checkpoint (a common-only pass, then the real one):
  the first find_latest restores the snapshot (collective), load() rebuilds a flat TASD from it; Megatron's
  to_state_dict() then matches shards by id and broadcasts the data-parallel-deduplicated ones back. When
  the newest snapshots are of another layout, `reshard()` opens them and load() hands back its ReshardedLoad
  (reshard.py), which fills the new layout's shards from them.
"""
from __future__ import annotations

import functools
import json
import time
from operator import attrgetter

from ...capture import Snapshotter
from ...snapshot import ShardSpec, Sharded

NONE = -1


def replica_tuple(replica_id) -> tuple[int, ...]:
    return (int(replica_id),) if isinstance(replica_id, int) else tuple(int(r) for r in replica_id)


def shard_spec(sh, *, deduplicated: bool) -> ShardSpec:
    """A Megatron ShardedTensor's place in the model. `main` marks the one stored copy a loader reads: all
    replica coordinates 0, except that with data-parallel deduplication the data-parallel coordinate (the
    last) is whichever rank Megatron chose to store it."""
    replica = replica_tuple(sh.replica_id)
    counted = replica[:-1] if deduplicated else replica
    return ShardSpec(sh.key, tuple(sh.global_shape), offset=tuple(sh.global_offset),
                     shape=(1,) * sh.prepend_axis_num + tuple(sh.local_shape), replica=replica,
                     main=all(r == 0 for r in counted), prepend_axis_num=sh.prepend_axis_num,
                     axis_fragmentations=tuple(sh.axis_fragmentations) if sh.axis_fragmentations else None)


_IDENT = attrgetter("key", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
                    "prepend_axis_num", "allow_shape_mismatch", "flattened_range")
_DATA = attrgetter("data")


def _description(sh) -> dict:
    """What rebuilds a ShardedTensor on load but its data (Megatron matches shards by key and offset)."""
    if sh.flattened_range is not None:  # rejected by Megatron 0.19.2 itself; never produced
        raise ValueError(f"{sh.key}: flattened_range shards are not supported")
    replica = replica_tuple(sh.replica_id)
    return {"key": sh.key, "local_shape": [int(d) for d in sh.local_shape],
            "global_shape": [int(d) for d in sh.global_shape], "global_offset": [int(d) for d in sh.global_offset],
            "axis_fragmentations": None if sh.axis_fragmentations is None else [int(a) for a in sh.axis_fragmentations],
            "replica_id": replica[0] if isinstance(sh.replica_id, int) else list(replica),
            "prepend_axis_num": int(sh.prepend_axis_num), "allow_shape_mismatch": bool(sh.allow_shape_mismatch)}


class Described:
    """What to_tree derives from the shards' descriptions (their specs, and one JSON text of them), kept while
    the descriptions stay the same: Megatron builds new ShardedTensors every save, for the same shards, and
    building specs and entries was most of the cost of a save on our side (about 13 us a tensor)."""

    def __init__(self):
        self.idents: list | None = None
        self.specs: list[tuple[ShardSpec, ...]] = []
        self.text = ""


def to_tree(tasd, *, deduplicated: bool, extra_specs=lambda sh: (), described: Described | None = None) -> dict:
    """TASD -> a plain tree of specs and values: the tensors' descriptions as one JSON text (a single value to
    flatten, not a dict per tensor) beside their data. `extra_specs(sh)`: more specs for the same elements (the
    model-space place of distributed-optimizer bucket slices). `described`: an earlier call's, reused when
    every description is the same, else updated."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tensors, objects = [], []
    for sh in nested_values(tasd.sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            if sh.data is not None:  # else another data-parallel rank stores this shard
                tensors.append(sh)
        elif isinstance(sh, ShardedObject):
            objects.append({"key": sh.key, "global_shape": tuple(sh.global_shape),
                            "global_offset": tuple(sh.global_offset), "replica_id": sh.replica_id, "data": sh.data})
    described = described or Described()
    idents = list(map(_IDENT, tensors))
    if idents != described.idents:
        described.text = json.dumps([_description(sh) for sh in tensors], separators=(",", ":"))
        described.specs = [(shard_spec(sh, deduplicated=deduplicated), *extra_specs(sh)) for sh in tensors]
        described.idents = idents
    data = list(map(Sharded, map(_DATA, tensors), described.specs))
    return {"common": tasd.common, "tensors": {"described": described.text, "data": data}, "objects": objects}


def tensor_entries(tensors) -> list[dict]:
    """A tree's tensors as one dict each (so inmem_ft releases before the JSON text stored them)."""
    if isinstance(tensors, list):
        return tensors
    return [{**d, "data": t} for d, t in zip(json.loads(tensors["described"]), tensors["data"])]


def _standalone(value):
    """Tensors of the common part and of ShardedObjects as tensors of their own. Restore hands back views of
    the whole slot (or of one private copy of it), and two of Megatron's uses of these small tensors go wrong
    on such a view: torch.set_rng_state crashes (SIGSEGV) on one that does not start its storage, and the
    optimizer's load deep-copies the common Adam `step` once per parameter, and a deep copy of a view copies
    its whole storage (measured: 3.1 s, and a slot's size of memory per parameter, for a 21 MB slot and 52
    parameters; at 117.6 MB and 76 parameters the kernel killed the rank for memory)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _standalone(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_standalone(v) for v in value)
    return value


def from_tree(tree: dict):
    """The inverse: a flat TASD (only shard ids matter to to_state_dict, not the nesting)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sharded = {}
    for i, t in enumerate(tensor_entries(tree["tensors"])):
        replica, fragmentations = t["replica_id"], t["axis_fragmentations"]
        sharded[f"t{i}"] = ShardedTensor(t["key"], t["data"], t["data"].dtype, tuple(t["local_shape"]),
                                         tuple(t["global_shape"]), tuple(t["global_offset"]),
                                         tuple(fragmentations) if fragmentations is not None else None,
                                         tuple(replica) if isinstance(replica, (list, tuple)) else replica,
                                         t["prepend_axis_num"], t["allow_shape_mismatch"])
    for i, o in enumerate(tree["objects"]):
        sharded[f"o{i}"] = ShardedObject(o["key"], _standalone(o["data"]), o["global_shape"], o["global_offset"],
                                         o["replica_id"])
    return MCoreTensorAwareStateDict(common=_standalone(tree["common"]), sharded_state_dict=sharded)


class InmemCheckpointManager:
    """find_latest / save / load, as Megatron calls nvidia-resiliency-ext's LocalCheckpointManager."""

    def __init__(self, snap: Snapshotter, local_ckpt_dir: str, topology, *, deduplicated: bool,
                 extra_specs=lambda sh: (), reshard=None):
        """topology(iteration) -> the Topology record of a snapshot (also this job's layout, which restore
        compares); extra_specs: see to_tree; reshard(source) -> a ReshardedLoad of the newest snapshots of
        another layout (collective; `source`: the restore's capture.resume.ReshardSource), or None to stop with
        LayoutChanged instead."""
        self.snap, self.local_ckpt_dir = snap, local_ckpt_dir  # the dir only appears in Megatron's log lines
        self._topology, self._deduplicated, self._extra_specs = topology, deduplicated, extra_specs
        self._reshard = reshard
        self._restored: dict | None = None
        self._source = None  # the ReshardSource the ReshardedLoad reads through, closed by release()
        self.resharded = None  # the ReshardedLoad, when the snapshot was of another layout
        self._described = Described()  # to_tree's, kept across saves
        self._looked = self._served = False
        self.restore_t0: float | None = None

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, tasd, iteration: int, is_async: bool = False):
        tree = to_tree(tasd, deduplicated=self._deduplicated, extra_specs=self._extra_specs,
                       described=self._described)
        # overlap: the copy runs behind the next forward/backward; the optimizer step fences (see patch.py).
        commit = self.snap.save(int(iteration), tree, overlap=True, topology=self._topology(iteration))
        if not is_async:
            return None
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        # No worker process (async_fn None): the commit thread does the work, and Megatron finalizes the
        # request once that commit is done on every rank (patch.finalize_when_committed); wait_for raises
        # if it failed and on_error is 'raise'.
        return AsyncRequest(None, (commit,), [functools.partial(self.snap.wait_for, commit)])

    # ---- load ---------------------------------------------------------------------------------------------
    def find_latest(self) -> int:
        """Collective. The first call restores (every rank agrees on the newest complete step)."""
        if not self._looked:
            self._looked = True
            self.restore_t0 = time.perf_counter()
            # Views of the slots: the Handle runs Megatron's load inside PrivateAfterLoad; what lived on the
            # GPU comes back there (to_device).
            layout = self._topology(0)
            got = self.snap.resume(layout=layout, views=True, reshard=self._opener(layout), summary=False,
                                   to_device=True)
            self._restored, self._source = got.state, got.reshard
            if got.reshard is not None:
                if self._reshard is None:
                    got.reshard.refuse()
                try:
                    self.resharded = self._reshard(got.reshard)
                except BaseException:
                    got.reshard.close()
                    raise
        if self.resharded is not None:
            return self.resharded.rs.step
        return self.snap.last_restore.step if self._restored is not None else NONE

    def _opener(self, layout):
        if self._reshard is None:
            return None
        from ...universal.reshard import FromMemory  # with its pyarrow, imported by install() where it reshards

        return FromMemory.of(self.snap, layout)

    def load(self):
        if self.resharded is not None:
            self._served = True
            rs = self.resharded.rs
            return self.resharded, f"inmem_ft snapshot of iteration {rs.step} on {rs.old.layout()}, resharded"
        if self._restored is None:
            raise RuntimeError("inmem_ft: Megatron asked to load a snapshot, but find_latest() found none")
        self._served = True
        return from_tree(self._restored), f"inmem_ft snapshot of iteration {self.snap.last_restore.step}"

    def release(self) -> bool:
        """After Megatron's load: drop the restored copy. True if Megatron loaded it (it takes a newer
        persistent checkpoint under --load instead, if there is one)."""
        self._restored = None
        if self._source is not None:
            self._source.close()
        return self._served
