"""Tensor parallelism through an `mpu` (Megatron-DeepSpeed's way of running TP on DeepSpeed) under the adapter.

Each tensor-parallel rank holds a slice of a split parameter (column-parallel weights and biases along dim 0,
row-parallel weights along dim 1) and a whole copy of the others (layer norms, row-parallel biases). A
snapshot keys both by the parameter's layout-free key (its module name, or `layer_XX.<name>` under a
pipeline) with the global shape: a slice is the box of the global tensor at `rank * local` along its
partition dim, so a reader on another TP size (or TP 1) reads whole tensors or its own slices by the same
keys. A replicated parameter's copies are the same bytes on every TP rank: TP rank 0's is `main`, the
others' are kept as replicas (the core splits a replicated subtree across one group, the data-parallel one;
across TP ranks each stores its copy and the catalog names one).

Which parameters are split, and along which dim, is read from the module where Megatron marks it
(`tensor_model_parallel`, `partition_dim`, `partition_stride` attributes), else from the config's
`partition_dims` rules; install() checks that every parameter taken as replicated is the same on every TP
rank, so an unmarked split parameter is refused, not saved as a wrong box.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib

import torch

from ...errors import ConfigError
from ...snapshot import Sharded
from ...snapshot.annotate import OPTIMIZER_STATE


def size_of(engine) -> int:
    """The engine's tensor-parallel size, through its mpu (a PipelineModule's grid under a pipeline)."""
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    return int(bwc_tensor_model_parallel_world_size(getattr(engine, "mpu", None)))


def partition_dim(name: str, key: str, p: torch.Tensor, rules: dict | None) -> int | None:
    """The dim a parameter is split along across TP ranks (None: replicated): Megatron's attributes, else the
    first rule whose pattern matches the module name or the key."""
    if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False):
        dim = getattr(p, "partition_dim", None)
        stride = getattr(p, "partition_stride", 1)
        if stride != 1:
            raise ConfigError(f"inmem_ft: {name} is split across tensor-parallel ranks with partition_stride "
                              f"{stride}; only contiguous slices (stride 1) are supported")
        if dim is None:
            raise ConfigError(f"inmem_ft: {name} is marked tensor_model_parallel without a partition_dim; set it "
                              f"on the parameter or add a 'partition_dims' rule to the inmem_ft config")
        return _checked(name, int(dim), p, "its partition_dim attribute")
    for pattern, dim in (rules or {}).items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(key, pattern):
            return None if dim is None else _checked(name, dim, p, f"partition_dims rule {pattern!r}")
    return None


def _checked(name: str, dim: int, p: torch.Tensor, said: str) -> int:
    if not 0 <= dim < p.dim():
        raise ConfigError(f"inmem_ft: {said} splits {name} along dim {dim}, but it has {p.dim()} dims")
    return dim


class TensorParallel:
    """This rank's place among the tensor-parallel ranks and the partition dim of every parameter, by key."""

    def __init__(self, engine, key_of, rules: dict | None):
        """key_of: module parameter name -> its shard-map key (identity, or the pipeline's layer key)."""
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_rank

        mpu = engine.mpu
        self.size, self.rank = size_of(engine), int(bwc_tensor_model_parallel_rank(mpu))
        self.group = bwc_tensor_model_parallel_group(mpu)
        self.dims: dict[str, int | None] = {}
        params = []
        for name, p in engine.module.named_parameters():
            key = key_of(name)
            self.dims[key] = partition_dim(name, key, p, rules)
            params.append((name, key, p))
        self._check(params)

    def _check(self, params) -> None:
        """Collective over the TP group: every rank splits the same parameters into slices of one shape, and a
        parameter taken as replicated has the same bytes everywhere (else it is an unmarked split one)."""
        import deepspeed.comm as dist

        mine = [(key, self.dims[key], tuple(p.shape), None if self.dims[key] is not None else _digest(p))
                for _, key, p in params]
        everyone = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        if len({len(theirs) for theirs in everyone}) > 1:
            raise ConfigError(f"inmem_ft: the tensor-parallel ranks hold different numbers of parameters "
                              f"({[len(theirs) for theirs in everyone]}); build the same model on every rank")
        for (name, key, p), *theirs in zip(params, *everyone):
            if len(set(theirs)) == 1:
                continue
            if len({t[:3] for t in theirs}) > 1:
                raise ConfigError(f"inmem_ft: {name} differs in partition dim or shape across tensor-parallel "
                                  f"ranks ({sorted({t[1:3] for t in theirs}, key=str)}); build the same model on "
                                  f"every rank")
            raise ConfigError(f"inmem_ft: {name} is not marked as split across tensor-parallel ranks (no "
                              f"tensor_model_parallel/partition_dim attributes, no 'partition_dims' rule) but "
                              f"differs between them; mark it, or add \"partition_dims\": {{\"{name}\": <dim>}} to "
                              f"the inmem_ft config (if it is meant to be the same on every rank, initialize it the "
                              f"same)")

    # ---- shard specs ----------------------------------------------------------------------------------------
    def box(self, key: str, shape: tuple) -> tuple[tuple, tuple]:
        """(global shape, offset of this rank's slice) of the parameter `key` whose local shape is `shape`."""
        shape, dim = tuple(shape), self.dims.get(key)
        if dim is None:
            return shape, (0,) * len(shape)
        full = shape[:dim] + (shape[dim] * self.size,) + shape[dim + 1:]
        return full, tuple(self.rank * shape[dim] if d == dim else 0 for d in range(len(shape)))

    def place(self, tree):
        """Re-place, in place, the specs in `tree` (wrappers the adapter built for this snapshot) from this
        rank's local tensors to their boxes in the global ones; replicated tensors are main on TP rank 0."""
        if isinstance(tree, Sharded):
            tree.specs = tuple(self._placed(s) for s in tree.specs)
        elif isinstance(tree, dict):
            for value in tree.values():
                self.place(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                self.place(value)
        return tree

    def _placed(self, spec):
        key = spec.key
        if key.startswith(OPTIMIZER_STATE):
            key = key[len(OPTIMIZER_STATE):].split(".", 1)[1]
        if self.dims.get(key) is None:
            return dataclasses.replace(spec, main=spec.main and self.rank == 0)
        full, offset = self.box(key, spec.shape)
        return dataclasses.replace(spec, global_shape=full, offset=offset)


def _digest(p: torch.Tensor) -> str:
    data = p.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def check_autotp(engine) -> None:
    """DeepSpeed's AutoTP training (`"tensor_parallel": {"autotp_size": N}`) is refused by name: its layers
    may split unevenly and fuse sub-parameters (qkv) in ways a box of the global tensor does not describe."""
    size = engine.autotp_size() if hasattr(engine, "autotp_size") else 0
    if size and size > 1:
        raise ConfigError(f"inmem_ft: DeepSpeed AutoTP training (tensor_parallel.autotp_size {size}) is not "
                          f"supported; build the model with Megatron-style tensor-parallel layers and pass their "
                          f"groups as deepspeed.initialize(mpu=...), or train with autotp_size 1")
