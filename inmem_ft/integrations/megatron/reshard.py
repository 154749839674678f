"""A Megatron job back on another TP/PP/DP layout: each new rank fills the state dict Megatron asks it to load
from the old layout's snapshots (universal/reshard.py finds them and reads any piece of any global tensor:
this node's shared memory, other nodes, parity for a lost one). Translation only, at Megatron's own load
(megatron-core 0.19.2): load() hands Megatron a `ReshardedLoad` instead of a stored TASD, and its
to_state_dict(template) answers every shard id of the new rank's template:

- ShardedTensors by key and box (global offset + local shape; layer-stacked keys do not depend on PP, TP is
  the box), from the old layout's `main` fragments: only the bytes of the rank's own boxes travel;
- the distributed optimizer's bucket slices (format dp_reshardable, keyed by bucket, not by parameter)
  through this rank's bucket -> parameter map (layout.dp_slices) from the model-space pieces every snapshot
  records beside its own slices (`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>`, a flat range of
  the parameter's box); padding between parameters is zeros, as Megatron keeps it;
- ShardedObjects: `rng_state` is the old rank's at the same (tp, pp, dp) coordinates, each taken modulo
  the old layout's size (universal/reshard.py's rule: with TP 1 -> 2 both new TP ranks take old TP rank 0's
  streams, so their dropout masks repeat each other's until the job reseeds); the distributed optimizer's
  `per_bucket_numel*` are this rank's own (they describe its buckets); its other records (param groups with
  their hyperparameters and Adam's step) the mapped old rank's, whose groups Megatron pairs by their
  identifiers; any other object the old layout's copy at the same key and offset;
- the common part: old rank 0's (iteration, consumed samples, scheduler, rerun state), with the parallel
  sizes in its args set to this job's. Megatron then loads it as a checkpoint of this layout: it refuses a
  (TP, PP) change for dp_reshardable optimizer state and drops the RNG state on one, both of which the
  fill above makes right.
"""
from __future__ import annotations

import copy
import time

import torch

from ...errors import InmemFTError
from ...universal.reshard import Resharding
from .layout import MegatronLayout

RNG = "rng_state"
DISTOPT = "optimizer.distributed.dp_group_idx_"
OWN_RECORDS = ("per_bucket_numel", "per_bucket_numel_unpadded")
_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "world_size",
          "virtual_pipeline_model_parallel_size")


class ReshardedLoad:
    """What the manager's load() returns on a reshard: Megatron calls only to_state_dict on it."""

    def __init__(self, rs: Resharding, layout: MegatronLayout, agree_min):
        self.rs, self.layout, self.agree_min = rs, layout, agree_min
        self.common = _translated(rs.job_state("common"), layout.args)

    def to_state_dict(self, sharded_state_dict, algo="atomic", parallelization_group=None, **kwargs):
        from .manager import from_tree

        tree, error = {"common": self.common, "tensors": [], "objects": []}, None
        if sharded_state_dict:  # the first, common-only pass of load_checkpoint asks for nothing else
            t0 = time.perf_counter()
            try:
                tree = self._fill(sharded_state_dict)
            except Exception as e:  # every rank must hear of it before Megatron's collectives
                error = e
            self.rs.seconds["read_set"] = round(time.perf_counter() - t0, 4)
            if not self.agree_min(int(error is None)):
                raise error or InmemFTError(f"another rank failed to read its share of step {self.rs.step} of the "
                                            f"old layout ({self.rs.old.layout()}); its log says why")
        # Every rank now holds every shard it asked for: nothing to exchange among data-parallel ranks.
        return from_tree(tree).to_state_dict(sharded_state_dict, algo="atomic",
                                             parallelization_group=parallelization_group, **kwargs)

    # ---- filling the template --------------------------------------------------------------------------
    def _fill(self, template) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        leaves = []
        for sh in nested_values(template):
            leaves += list(nested_values(sh.build())) if isinstance(sh, ShardedTensorFactory) else [sh]
        old_objects = {rank: None for rank in self.rs.source.manifests}
        tensors, objects = [], []
        for sh in leaves:
            if isinstance(sh, ShardedTensor):
                tensors.append({"key": sh.key, "local_shape": tuple(sh.local_shape),
                                "global_shape": tuple(sh.global_shape), "global_offset": tuple(sh.global_offset),
                                "axis_fragmentations": sh.axis_fragmentations, "replica_id": sh.replica_id,
                                "prepend_axis_num": sh.prepend_axis_num,
                                "allow_shape_mismatch": sh.allow_shape_mismatch, "data": self._tensor(sh)})
            elif isinstance(sh, ShardedObject):
                objects.append({"key": sh.key, "global_shape": tuple(sh.global_shape),
                                "global_offset": tuple(sh.global_offset), "replica_id": sh.replica_id,
                                "data": self._object(sh, old_objects)})
        return {"common": self.common, "tensors": tensors, "objects": objects}

    def _tensor(self, sh) -> torch.Tensor:
        frags = self.rs.source.fragments
        box = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        out = self._target(sh)
        bucket, _, kind = sh.key.rpartition(".")
        if not bucket.startswith(DISTOPT):  # the old layout's buckets hold other parameters: never read them
            if sh.key not in frags:
                raise InmemFTError(f"{sh.key}: this rank's state asks for it, the old layout's snapshot of step "
                                   f"{self.rs.step} ({self.rs.old.layout()}) holds no such tensor: restart with "
                                   f"the model and optimizer it was taken with")
            self._check(sh.key, tuple(sh.global_shape), out.dtype)
            self.rs.source.piece(sh.key, offset=sh.global_offset, shape=box, out=out.view(-1))
            return out
        hit = self.layout.bucket_params.get((bucket, sh.global_offset[0]))
        if hit is None:  # padding between parameters of the bucket
            return out.zero_()
        param, lo, hi = hit
        key = f"optimizer.state.{'fp32_param' if kind == 'param' else kind}.{param.key}"
        if key not in frags and kind == "param":  # an old layout without master copies: the weights are fp32
            key = param.key
        if key not in frags:
            raise InmemFTError(f"{key}: the old layout's snapshot of step {self.rs.step} ({self.rs.old.layout()}) "
                               f"holds no such state (taken with another optimizer?): restart with the optimizer "
                               f"it was taken with")
        self._check(key, tuple(param.global_shape), out.dtype)
        self.rs.source.piece(key, offset=param.global_offset, shape=(1,) * param.prepend_axis_num +
                             tuple(param.local_shape), flat=(lo, hi), out=out.view(-1))
        return out

    @staticmethod
    def _target(sh) -> torch.Tensor:
        """The template's own tensor where it can take the bytes in place (its parameter: no second copy of
        the rank's state), else a new one."""
        data = sh.data
        if isinstance(data, torch.Tensor) and data.is_contiguous() and tuple(data.shape) == tuple(sh.local_shape):
            return data.detach()
        return torch.empty(tuple(sh.local_shape), dtype=sh.dtype)

    def _check(self, key: str, shape: tuple, dtype: torch.dtype) -> None:
        frags = self.rs.source.fragments
        if frags.shape(key) != shape:
            raise InmemFTError(f"{key}: global shape {shape} in this job, {frags.shape(key)} in the old layout's "
                               f"snapshot ({self.rs.old.layout()}); a padded vocabulary follows the TP size: pass "
                               f"--make-vocab-size-divisible-by so both layouts pad it alike, or restart with the "
                               f"original layout")
        if frags.dtype(key) != dtype:
            raise InmemFTError(f"{key}: {dtype} in this job, {frags.dtype(key)} in the old layout's snapshot: "
                               f"restart with the precision it was taken with")

    def _object(self, sh, old_objects: dict):
        if sh.key.startswith(DISTOPT) and sh.key.rpartition(".")[2] in OWN_RECORDS:
            return sh.data
        if sh.key == RNG:
            return self._old_object(self.rs.per_rank, old_objects, lambda o: o["key"] == RNG)
        if sh.key.startswith(DISTOPT):
            name = sh.key.rpartition(".")[2]
            return self._old_object(self.rs.per_rank, old_objects,
                                    lambda o: o["key"].startswith(DISTOPT) and o["key"].rpartition(".")[2] == name)
        for rank in sorted(old_objects):
            try:
                return self._old_object(rank, old_objects, lambda o: o["key"] == sh.key and
                                        tuple(o["global_offset"]) == tuple(sh.global_offset))
            except InmemFTError:
                continue
        raise InmemFTError(f"{sh.key} at {tuple(sh.global_offset)}: no rank of the old layout "
                           f"({self.rs.old.layout()}) holds it; restart with the model it was taken with")

    def _old_object(self, rank: int, cache: dict, match):
        if cache[rank] is None:
            cache[rank] = self.rs.source.state(rank, "objects")
        for o in cache[rank]:
            if match(o):
                return o["data"]
        raise InmemFTError(f"old rank {rank} of the snapshot of step {self.rs.step} ({self.rs.old.layout()}) holds "
                           f"no such object")


def _translated(common: dict, args) -> dict:
    """Old rank 0's common part, its args naming this job's parallel sizes (see the module docstring)."""
    ckpt_args = copy.copy(common["args"])
    for name in _SIZES:
        if hasattr(args, name):
            setattr(ckpt_args, name, getattr(args, name))
    return {**common, "args": ckpt_args}
