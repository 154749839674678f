"""A small GPT trained with DeepSpeed's pipeline engine (PipelineModule, ZeRO-0/1, fp32/bf16) and protected
by inmem_ft: the token embedding and the LM head are one tied layer on the first and last stage, blocks use
dropout (each stage's RNG is its own), and the data iterator has a position a resume must bring back.

Run one process per rank with the torchrun variables set (torchrun, `inmem-ft launch`, SimulatedCluster) and
an SMP per node; the pipeline has --pp stages and world/pp data-parallel replicas. Deterministic on CPU: a
resumed run reproduces the uninterrupted losses bit for bit.
"""
import argparse
import math
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import inmem_ft
from inmem_ft.examples.deepspeed_gpt import SEQ, VOCAB, Block, ds_config
from inmem_ft.examples.ds_common import add_run_args, counters, die_if_asked, finish, parse, resume, start

MICRO_BATCH, MICRO_BATCHES = 4, 2


class Positions(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.pos = nn.Embedding(SEQ, d)

    def forward(self, x):
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


def lm_head(embedding: nn.Embedding, x):
    return x @ embedding.weight.t() / math.sqrt(x.shape[-1])  # the token embedding, transposed (tied)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def pipeline(layers: int, d: int, heads: int, dropout: float, stages: int):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = [TiedLayerSpec("embed", nn.Embedding, VOCAB, d),
             LayerSpec(Positions, d),
             *[LayerSpec(Block, d, heads, dropout) for _ in range(layers)],
             LayerSpec(nn.LayerNorm, d),
             TiedLayerSpec("embed", nn.Embedding, VOCAB, d, forward_fn=lm_head)]
    # seed_layers: a layer's initial weights depend on its index only, not on which stage builds it
    return PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, partition_method="uniform",
                          seed_layers=True, base_seed=0)


class Batches:
    """Micro-batch `position` of a data-parallel replica is a pure function of (seed, dp rank, position); the
    first and the last stage each draw every micro-batch (inputs and labels), so their positions agree. The
    noise draws on Python's and numpy's global RNGs, which inmem_ft carries per rank."""

    def __init__(self, seed: int, dp_rank: int):
        self.seed, self.dp_rank, self.position = seed, dp_rank, 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 10_007 + self.position)
        self.position += 1
        start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (MICRO_BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        if random.random() < 0.5:
            seq[0, int(np.random.randint(1, SEQ))] = int(np.random.randint(VOCAB))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1])
    add_run_args(p, dump_help="ZeRO-1: rank 0 writes every global parameter, fp32 master and Adam moment, keyed as "
                              "the shard map keys them, and the counters (torch.save) to PATH")
    args = parse(p)

    deepspeed = start()
    from inmem_ft.integrations.deepspeed import install

    rank = deepspeed.comm.get_rank()
    # one optimizer step is MICRO_BATCHES micro-batches through the stages
    config = ds_config(args.zero_stage, args.dtype, args.interval, MICRO_BATCH, MICRO_BATCHES)
    if args.no_inmem:
        config.pop("inmem_ft")
    model = pipeline(args.layers, args.hidden, 4, 0.1, args.pp)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)
    seed = 1234 + 17 * rank  # per-rank (so per-stage) dropout masks and noise
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    data = Batches(1234, engine.grid.data_parallel_id)

    handle = install(engine, extra_state=lambda: {"position": data.position})
    first = resume(handle, data)
    if args.dump_full and args.dump_step == first:
        dump_full(engine, data, args.dump_full)
    for step in range(first + 1, args.steps + 1):
        loss = engine.train_batch(data)  # inmem_ft snapshots after every `interval`th optimizer step
        inmem_ft.report_loss(step, loss.item(), args.loss_log)  # the mean over micro-batches and replicas
        if args.dump_full and args.dump_step == step:
            dump_full(engine, data, args.dump_full)
        die_if_asked(args, step, rank, handle)
    finish(args, engine, handle)


def dump_full(engine, data: Batches, path: str) -> None:
    """Collective: every stage's parameters with their ZeRO-1 fp32 masters and Adam moments, gathered the way
    DeepSpeed itself does and keyed by layer (a tied parameter once, from the stage of its first layer), and
    the counters a resume carries; rank 0 writes them to `path`."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from inmem_ft.integrations.deepspeed.pipeline import Pipeline

    pipe, mine = Pipeline(engine), {}
    for name, p in engine.module.named_parameters():
        key, main = pipe.param_key(name)
        got = {key: p.detach().clone(), f"optimizer.state.fp32_param.{key}": safe_get_full_fp32_param(p).clone()}
        for kind in ("exp_avg", "exp_avg_sq"):
            got[f"optimizer.state.{kind}.{key}"] = safe_get_full_optimizer_state(p, kind).clone()
        if main:
            mine.update(got)
    everyone = [None] * deepspeed.comm.get_world_size()
    deepspeed.comm.all_gather_object(everyone, mine)
    if deepspeed.comm.get_rank() == 0:
        full = {k: v for part in everyone for k, v in part.items()}
        full["_counters"] = counters(engine, data.position)
        torch.save(full, path)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
