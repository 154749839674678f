"""A small mixture-of-experts GPT trained with DeepSpeed (deepspeed.moe.layer.MoE, expert parallelism, ZeRO-1/2,
fp32/bf16) and protected by inmem_ft: every block's MLP is an MoE layer whose experts are spread over --ep
expert-parallel ranks, the other world/ep ranks of each expert are its expert-data-parallel replicas.

Run one process per rank with the torchrun variables set (torchrun, `inmem-ft launch`, SimulatedCluster) and
an SMP per node. Deterministic on CPU: a resumed run reproduces the uninterrupted losses bit for bit.
"""
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import inmem_ft
from inmem_ft.examples.deepspeed_gpt import (MICRO_BATCH, SEQ, VOCAB, Block, GlobalBatches, TokenStream, ds_config,
                                             train_step)
from inmem_ft.examples.ds_common import add_run_args, counters, die_if_asked, finish, parse, resume, start

AUX_WEIGHT = 0.01  # the gate's load-balancing loss, as a share of the LM loss


class MoEBlock(Block):
    def __init__(self, d: int, heads: int, dropout: float, experts: int, ep: int):
        from deepspeed.moe.layer import MoE

        super().__init__(d, heads, dropout)
        expert = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        # min_capacity: every expert takes all of a micro-batch's tokens, so no token is dropped
        self.mlp = MoE(hidden_size=d, expert=expert, num_experts=experts, ep_size=ep, k=1,
                       min_capacity=MICRO_BATCH * SEQ)

    def forward(self, x):
        x = self.attend(x)
        out, aux, _ = self.mlp(self.ln2(x))
        return x + self.drop(out), aux


class MoEGPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, dropout: float, experts: int, ep: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(MoEBlock(d, heads, dropout, experts, ep) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x, aux = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)), 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1)) + AUX_WEIGHT * aux


def full_state(engine) -> dict:
    """Collective: every global parameter with its ZeRO fp32 master and Adam moments, gathered the way DeepSpeed
    itself does and keyed as the shard map keys them (an expert by its global id); rank 0 gets them all."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from inmem_ft.integrations.deepspeed.moe import Experts

    experts, mine, opt = Experts(engine), {}, engine.optimizer
    # DeepSpeed 0.19.8 links each parameter to its optimizer state right after the first param group's first
    # step, before the other groups (MoE's expert groups) have any state: link them again to read them.
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        key = experts.key_of(name)
        mine[key] = p.detach().clone()
        mine[f"optimizer.state.fp32_param.{key}"] = safe_get_full_fp32_param(p).clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            mine[f"optimizer.state.{kind}.{key}"] = safe_get_full_optimizer_state(p, kind).clone()
    everyone = [None] * deepspeed.comm.get_world_size()
    deepspeed.comm.all_gather_object(everyone, mine)  # expert-data-parallel replicas send the same values
    return {k: v for part in everyone for k, v in part.items()}


def dump_full(engine, stream, path: str, restored) -> None:
    """full_state (collective) and the counters a resume must carry, to `path` from rank 0."""
    import deepspeed

    full = full_state(engine)
    if deepspeed.comm.get_rank() == 0:
        full["_counters"] = {**counters(engine, stream.position),
                             "restored": str(restored.tier) if restored else None}
        torch.save(full, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides the world and --experts)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--zero-stage", type=int, default=1, choices=[1, 2])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=None,
                   help="train every DP layout on the same global batches of this many sequences")
    add_run_args(p, hidden=32, dump_help="rank 0 writes every global parameter, fp32 master and Adam moment, keyed "
                                         "as the shard map keys them, and the counters (torch.save) to PATH")
    args = parse(p)

    deepspeed = start()
    from inmem_ft.integrations.deepspeed import install

    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    micro = args.global_batch // world if args.global_batch else MICRO_BATCH
    config = ds_config(args.zero_stage, args.dtype, args.interval, micro)
    if args.no_inmem:
        config.pop("inmem_ft")
    torch.manual_seed(0)  # the same initial weights on every rank, whatever the expert-parallel size
    model = MoEGPT(args.layers, args.hidden, 4, args.dropout, args.experts, args.ep)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seed = 1234 + 17 * rank  # per-rank dropout masks, token-selection draws and noise
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    stream = GlobalBatches(1234, args.global_batch, rank, world) if args.global_batch else TokenStream(1234, rank)

    handle = install(engine, extra_state=lambda: {"position": stream.position})
    first = resume(handle, stream)
    if args.dump_full and args.dump_step == first:
        dump_full(engine, stream, args.dump_full, handle.restored if handle is not None else None)
    for step in range(first + 1, args.steps + 1):
        inmem_ft.report_loss(step, train_step(engine, stream), args.loss_log)
        if args.dump_full and args.dump_step == step:
            dump_full(engine, stream, args.dump_full, None)
        die_if_asked(args, step, rank, handle)
    finish(args, engine, handle)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
