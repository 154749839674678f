"""A small GPT in 3D (tensor x pipeline x data parallel) on DeepSpeed, Megatron-DeepSpeed's way, protected by
inmem_ft: column- and row-parallel linears (attention heads and the MLP split across --tp ranks, marked with
Megatron's `tensor_model_parallel`/`partition_dim` attributes), their groups given by an `mpu` built from torch
process groups, the blocks in --pp pipeline stages of a PipelineModule (or, --pp 0, one plain module whose mpu
goes to deepspeed.initialize(mpu=...)), world/(tp*pp) data-parallel replicas.

Every TP size starts from the same weights (each layer draws its full weights and keeps its slice), so a
snapshot of one TP size reshards into another. Run one process per rank with the torchrun variables set
(torchrun, `inmem-ft launch`, SimulatedCluster) and an SMP per node. Deterministic on CPU: a resumed run
reproduces the uninterrupted losses bit for bit.
"""
import argparse
import math
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import inmem_ft
from inmem_ft.examples.deepspeed_gpt import VOCAB, ds_config
from inmem_ft.examples.deepspeed_pipe import MICRO_BATCH, MICRO_BATCHES, Batches, Positions, lm_head, loss_fn
from inmem_ft.examples.ds_common import add_run_args, counters, die_if_asked, finish, parse, resume, start


class ModelParallelUnit:
    """Megatron-DeepSpeed's `mpu` interface over torch process groups, for the ranks of a DeepSpeed
    PipeModelDataParallelTopology (pipe outermost, tensor-parallel `model` innermost, as DeepSpeed's pipeline
    grid numbers them). Model parallel = the tensor x pipeline ranks of one data-parallel replica."""

    def __init__(self, topology):
        self.topology, rank = topology, dist.get_rank()
        coord = topology.get_coord(rank)
        self.tp_rank, self.pp_rank, self.dp_rank = coord.model, coord.pipe, coord.data
        self.tp_group, self.tp_ranks = self._groups(topology.get_axis_comm_lists("model"), rank)
        self.pp_group, _ = self._groups(topology.get_axis_comm_lists("pipe"), rank)
        self.dp_group, _ = self._groups(topology.get_axis_comm_lists("data"), rank)
        replicas = [topology.filter_match(data=d) for d in range(topology.get_dim("data"))]
        self.mp_group, self.mp_ranks = self._groups(replicas, rank)

    @staticmethod
    def _groups(lists, rank):
        """Every rank creates every group (torch's rule), in the same order; returns the one holding `rank`."""
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (group, ranks)
        return mine

    def get_tensor_model_parallel_rank(self):
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self):
        return len(self.tp_ranks)

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_src_rank(self):
        return self.tp_ranks[0]

    def get_model_parallel_rank(self):
        return self.mp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self):
        return len(self.mp_ranks)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.topology.get_dim("data")

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipe_parallel_rank(self):
        return self.pp_rank

    def get_pipe_parallel_world_size(self):
        return self.topology.get_dim("pipe")

    def get_pipe_parallel_group(self):
        return self.pp_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input's gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _slice(full: torch.Tensor, dim: int, mpu) -> nn.Parameter:
    """This TP rank's contiguous slice of `full` along `dim`, marked as Megatron marks split parameters."""
    size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    p = nn.Parameter(full.detach().chunk(size, dim)[rank].clone())
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    return p


class ColumnParallelLinear(nn.Module):
    """Output features split across TP ranks (weight and bias along dim 0); the input is the whole."""

    def __init__(self, d_in: int, d_out: int, mpu):
        super().__init__()
        full = nn.Linear(d_in, d_out)  # drawn whole: every TP size starts from the same weights
        self.weight, self.bias = _slice(full.weight, 0, mpu), _slice(full.bias, 0, mpu)
        self.group = mpu.get_tensor_model_parallel_group()

    def forward(self, x):
        return F.linear(_CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across TP ranks (weight along dim 1); the partial outputs are summed, then the
    bias (the same on every TP rank) added."""

    def __init__(self, d_in: int, d_out: int, mpu):
        super().__init__()
        full = nn.Linear(d_in, d_out)
        self.weight, self.bias = _slice(full.weight, 1, mpu), nn.Parameter(full.bias.detach().clone())
        self.group = mpu.get_tensor_model_parallel_group()

    def forward(self, x):
        return _ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group) + self.bias


class Block(nn.Module):
    """deepspeed_gpt's block with its attention heads and MLP split across TP ranks. The qkv rows are laid out
    head by head ([heads, 3, head dim]), so a contiguous slice holds whole heads. Dropout only on the
    replicated activations, whose RNG is the same on every TP rank."""

    def __init__(self, d: int, heads: int, dropout: float, mpu):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = ColumnParallelLinear(d, 3 * d, mpu), RowParallelLinear(d, d, mpu)
        self.fc1, self.fc2 = ColumnParallelLinear(d, 4 * d, mpu), RowParallelLinear(4 * d, d, mpu)
        self.drop, self.head_dim = nn.Dropout(dropout), d // heads
        self.heads = heads // mpu.get_tensor_model_parallel_world_size()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def pipeline(layers: int, d: int, heads: int, dropout: float, mpu):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = [TiedLayerSpec("embed", nn.Embedding, VOCAB, d),
             LayerSpec(Positions, d),
             *[LayerSpec(Block, d, heads, dropout, mpu) for _ in range(layers)],
             LayerSpec(nn.LayerNorm, d),
             TiedLayerSpec("embed", nn.Embedding, VOCAB, d, forward_fn=lm_head)]
    # the mpu's topology: DeepSpeed's pipeline grid then numbers the ranks as the mpu's groups do
    return PipelineModule(specs, topology=mpu.topology, loss_fn=loss_fn, partition_method="uniform",
                          seed_layers=True, base_seed=0)


class GPT(nn.Module):
    """The same layers in one module (no pipeline): DeepSpeed gets the mpu from deepspeed.initialize."""

    def __init__(self, layers: int, d: int, heads: int, dropout: float, mpu):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), Positions(d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, mpu) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx, targets):
        x = self.pos(self.tok(idx))
        for block in self.blocks:
            x = block(x)
        return loss_fn(lm_head(self.tok, self.ln(x)), targets)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (0: one plain module, no PipelineModule)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2])
    add_run_args(p, dump_help="ZeRO-1: rank 0 writes every global parameter, fp32 master and Adam moment (TP "
                              "slices gathered), keyed as the shard map keys them, and the counters (torch.save) "
                              "to PATH (after a restore of the same layout, the moments are linked at the next "
                              "step only: dump after a resharding restore, or a step later)")
    args = parse(p)

    deepspeed = start()
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from inmem_ft.integrations.deepspeed import install

    rank, world = dist.get_rank(), dist.get_world_size()
    stages = max(args.pp, 1)
    mpu = ModelParallelUnit(PipeModelDataParallelTopology(stages, args.tp, world // (stages * args.tp)))
    config = ds_config(args.zero_stage, args.dtype, args.interval, MICRO_BATCH, MICRO_BATCHES)
    if args.no_inmem:
        config.pop("inmem_ft")
    if args.pp:
        model = pipeline(args.layers, args.hidden, 4, 0.1, mpu)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=config)
    else:
        torch.manual_seed(0)
        model = GPT(args.layers, args.hidden, 4, 0.1, mpu)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=config, mpu=mpu)
    # per (stage, replica) dropout masks and noise, the same on the TP ranks of one: their activations are one
    seed = 1234 + 17 * mpu.topology.get_rank(pipe=mpu.pp_rank, data=mpu.dp_rank, model=0)
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    data = Batches(1234, mpu.dp_rank)

    handle = install(engine, extra_state=lambda: {"position": data.position})
    first = resume(handle, data)
    if args.dump_full and args.dump_step == first:
        dump_full(engine, mpu, data, args.dump_full)
    for step in range(first + 1, args.steps + 1):
        loss = engine.train_batch(data) if args.pp else plain_step(engine, data)
        inmem_ft.report_loss(step, loss.item(), args.loss_log)
        if args.dump_full and args.dump_step == step:
            dump_full(engine, mpu, data, args.dump_full)
        die_if_asked(args, step, rank, handle)
    finish(args, engine, handle)


def plain_step(engine, data: Batches):
    """One optimizer step of MICRO_BATCHES micro-batches, as train_batch() takes it; the mean loss."""
    total = 0.0
    for _ in range(MICRO_BATCHES):
        loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    return total / MICRO_BATCHES


def dump_full(engine, mpu, data: Batches, path: str) -> None:
    """Collective: every parameter with its ZeRO-1 fp32 master and Adam moments, gathered the way DeepSpeed
    does within a TP rank and concatenated across TP ranks along the partition dim, keyed as the shard map keys
    them (a tied parameter once), and the counters a resume carries; rank 0 writes them to `path`."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from inmem_ft.integrations.deepspeed.pipeline import Pipeline
    from inmem_ft.integrations.deepspeed.tensor_parallel import partition_dim

    pipe = Pipeline(engine) if engine.pipeline_parallelism else None
    tp, mine = mpu.get_tensor_model_parallel_world_size(), {}
    for name, p in engine.module.named_parameters():
        key, main = pipe.param_key(name) if pipe else (name, True)
        dim = partition_dim(name, key, p, None)
        got = {key: p.detach(), f"optimizer.state.fp32_param.{key}": safe_get_full_fp32_param(p)}
        for kind in ("exp_avg", "exp_avg_sq"):
            got[f"optimizer.state.{kind}.{key}"] = safe_get_full_optimizer_state(p, kind)
        for k, local in got.items():
            if dim is not None and tp > 1:
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
                local = torch.cat(parts, dim)
            got[k] = local.clone()
        if main and mpu.tp_rank == 0:
            mine.update(got)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        full = {k: v for part in everyone for k, v in part.items()}
        full["_counters"] = counters(engine, data.position)
        torch.save(full, path)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
