"""What a resharding loader needs to know about a Megatron job's layout, read off Megatron's own objects
once after setup: the topology record of each snapshot, which model key every optimizer parameter is, and
where the distributed optimizer's bucket slices sit in model space (MEGATRON.md section 2)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...snapshot import ShardSpec, Topology
from ...snapshot.topology import hyperparameters
from .manager import replica_tuple

def model_shards(model) -> dict[int, object]:
    """id(parameter) -> the model ShardedTensor that describes it (key, box, replica)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.utils import unwrap_model

    out = {}
    for chunk in unwrap_model(model):
        for sh in nested_values(chunk.sharded_state_dict()):
            if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.nn.Parameter):
                out[id(sh.data)] = sh
    return out


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _model_param_groups(opt) -> list[list]:
    """The model parameters of each param group of one Megatron optimizer (its inner groups may hold copies)."""
    if hasattr(opt, "model_float16_groups"):  # DistributedOptimizer
        return [a + b for a, b in zip(opt.model_float16_groups, opt.model_fp32_groups)]
    if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
        return [a + b for a, b in zip(opt.float16_groups, opt.fp32_from_fp32_groups)]
    return [group["params"] for group in opt.optimizer.param_groups]


def dp_slices(optimizer):
    """(optimizer, bucket key, element offset in the bucket, model parameter, range of its flattened elements)
    of every parameter slice this rank's distributed optimizer holds, keyed and placed as
    DistributedOptimizer.sharded_param_state_dp_reshardable does (0.19.2); nothing for other optimizers."""
    for opt in _optimizers(optimizer):
        if not hasattr(opt, "gbuf_ranges"):
            continue
        dp_rank, dp_size = opt.data_parallel_group.rank(), opt.data_parallel_group.size()
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            for dtype, buckets in gbuf_range_maps.items():
                for bucket_idx, range_map in enumerate(buckets):
                    local_numel = opt.buffers[gbuf_idx].buckets[bucket_idx].grad_data.numel() // dp_size
                    key = (f"optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}.gbuf_idx_{gbuf_idx}"
                           f".dtype_{dtype}.bucket_idx_{bucket_idx}")
                    for param, ranges in range_map["param_map"].items():
                        yield opt, key, dp_rank * local_numel + ranges["gbuf_local"].start, param, ranges["param"]


class MegatronLayout:
    def __init__(self, args, model, optimizer):
        from megatron.core import parallel_state as mpu
        from .patch import installed_version

        self.args, self.optimizer = args, optimizer
        self.version = installed_version()  # checked by install() at startup
        self.sizes = dict(tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
                          dp=mpu.get_data_parallel_world_size(), ep=mpu.get_expert_model_parallel_world_size(),
                          vpp=args.virtual_pipeline_model_parallel_size or 1)
        self.coords = {"tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
                       "dp": mpu.get_data_parallel_rank()}
        shards = model_shards(model)
        self.group_keys = [[[shards[id(p)].key for p in params if id(p) in shards] for params in _model_param_groups(o)]
                           for o in _optimizers(optimizer)]
        self.bucket_params = self._bucket_params(shards) if args.use_distributed_optimizer else {}

    def topology(self, iteration: int) -> Topology:
        groups = []
        for opt, keys in zip(_optimizers(self.optimizer), self.group_keys):
            for group, group_keys in zip(opt.optimizer.param_groups, keys):
                groups.append({"keys": group_keys, **hyperparameters(group)})
        return Topology(framework="megatron", framework_version=self.version, world_size=dist.get_world_size(),
                        **self.sizes, coords=self.coords,
                        position={"iteration": int(iteration),
                                  "consumed_train_samples": int(self.args.consumed_train_samples)},
                        optimizer={"type": self.args.optimizer, "distributed": bool(self.args.use_distributed_optimizer),
                                   "param_groups": groups})

    # ---- distributed optimizer: bucket space -> model space ------------------------------------------------
    def _bucket_params(self, shards) -> dict[tuple[str, int], tuple[object, int, int]]:
        """(bucket key, element offset in the bucket) -> (model ShardedTensor, lo, hi): the slice [lo, hi) of
        the parameter's flattened box that this rank's optimizer holds there."""
        return {(key, offset): (shards[id(param)], span.start, span.end)
                for _, key, offset, param, span in dp_slices(self.optimizer) if id(param) in shards}

    def model_space_specs(self, sh) -> tuple[ShardSpec, ...]:
        """For a bucket slice `<bucket key>.{param,exp_avg,exp_avg_sq}`: the same elements as
        `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>`, a flat range of the parameter's box
        (the naming of Megatron's model-space optimizer format)."""
        bucket, _, state = sh.key.rpartition(".")
        hit = self.bucket_params.get((bucket, sh.global_offset[0]))
        if hit is None:
            return ()  # padding between parameters, or not a bucket slice
        param, lo, hi = hit
        replica = replica_tuple(param.replica_id)[:-1] + (0,)  # data-parallel ranks hold disjoint flat ranges
        key = f"optimizer.state.{'fp32_param' if state == 'param' else state}.{param.key}"
        return (ShardSpec(key, tuple(param.global_shape), offset=tuple(param.global_offset),
                          shape=(1,) * param.prepend_axis_num + tuple(param.local_shape), flat=(lo, hi),
                          replica=replica, main=all(r == 0 for r in replica), prepend_axis_num=param.prepend_axis_num,
                          axis_fragmentations=tuple(param.axis_fragmentations) if param.axis_fragmentations else None),)
