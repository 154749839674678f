"""A small GPT trained with DeepSpeed (ZeRO 0-3, fp32/bf16) and protected by inmem_ft.

The only inmem_ft lines a DeepSpeed script needs are the `"inmem_ft"` block in its JSON config and
`handle = install(engine, extra_state=...)` after deepspeed.initialize; the rest is an ordinary loop.
Run one process per rank with the torchrun variables set (torchrun, `inmem-ft launch`, SimulatedCluster)
and an SMP per node. Deterministic on CPU: a resumed run reproduces the uninterrupted losses bit for bit.
"""
import argparse
import hashlib
import json
import math
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import inmem_ft
from inmem_ft.examples import corrupt
from inmem_ft.examples.ds_common import add_run_args, counters, die_if_asked, finish, parse, resume, start

VOCAB, SEQ, MICRO_BATCH = 64, 32, 4


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop, self.heads = nn.Dropout(dropout), heads

    def attend(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        return x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))

    def forward(self, x):
        x = self.attend(x)
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, layers=2, d=64, heads=4, dropout=0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


class TokenStream:
    """Arithmetic token sequences (start, stride) with a little noise: learnable, so the loss falls.

    Batch `position` of rank `rank` is a pure function of (seed, rank, position); the position is the
    data state a resume must bring back. The noise draws on Python's and numpy's global RNGs on purpose:
    their states are part of what inmem_ft carries per rank.
    """

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank, self.position = seed, rank, 0

    def next(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (MICRO_BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        if random.random() < 0.5:  # python RNG
            seq[0, int(np.random.randint(1, SEQ))] = int(np.random.randint(VOCAB))  # numpy RNG
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class GlobalBatches:
    """Layout-independent data: batch `position` is `size` sequences drawn from (seed, position) alone, and
    data-parallel rank d of n trains on rows [d*size/n, (d+1)*size/n). Any DP size then trains on the same
    global batches, so runs on two layouts are comparable step by step (the loss up to reduction order)."""

    def __init__(self, seed: int, size: int, dp_rank: int, dp_size: int):
        if size % dp_size:
            raise SystemExit(f"--global-batch {size} is not divisible by the {dp_size} data-parallel ranks")
        self.seed, self.position = seed, 0
        self.rows = slice(dp_rank * size // dp_size, (dp_rank + 1) * size // dp_size)
        self.size = size

    def next(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        start = torch.randint(0, VOCAB, (self.size, 1), generator=g)
        stride = torch.randint(1, 4, (self.size, 1), generator=g)
        seq = ((start + stride * torch.arange(SEQ + 1)) % VOCAB)[self.rows]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def state_digest(engine) -> str:
    """A hash of every tensor this rank holds in the module and the optimizer, plus the counters."""
    h = hashlib.sha256()

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            h.update(str(obj.dtype).encode())
            h.update(obj.detach().float().contiguous().cpu().numpy().tobytes())
        elif isinstance(obj, dict):
            for k in obj:
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(engine.module.state_dict())
    walk(engine.optimizer.state_dict())
    h.update(json.dumps([engine.global_steps, engine.global_samples,
                         engine.lr_scheduler.state_dict() if engine.lr_scheduler else None]).encode())
    return h.hexdigest()


def full_state(engine, zero3_weights: bool = False) -> dict:
    """Every global tensor of the model and its optimizer, keyed as inmem_ft's shard map keys them, gathered
    the way DeepSpeed itself does (collective under ZeRO-3): the ground truth a shard-map reader must rebuild.
    A ZeRO-3 snapshot holds no module weights (they are its fp32 masters, rounded): `zero3_weights` gathers
    them too."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt, out = engine.optimizer, {}
    stage = engine.zero_optimization_stage()
    lp_groups = getattr(opt, "fp16_groups", None)  # ZeRO-0 bf16: fp32 copies stand beside these
    for name, p in engine.module.named_parameters():
        if stage < 3 or zero3_weights:
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                out[name] = p.detach().clone()
        fp32 = safe_get_full_fp32_param(p)
        if fp32 is not None:
            out[f"optimizer.state.fp32_param.{name}"] = fp32.detach().clone()
            for kind in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{kind}.{name}"] = safe_get_full_optimizer_state(p, kind).detach().clone()
            continue
        master = p  # ZeRO-0: the optimizer holds the parameter itself, or (bf16) an fp32 copy of it
        if lp_groups is not None:
            g, i = next((g, i) for g, group in enumerate(lp_groups) for i, q in enumerate(group) if q is p)
            master = opt.fp32_groups[g][i]
            out[f"optimizer.state.fp32_param.{name}"] = master.detach().clone()
        state = getattr(opt, "optimizer", opt).state[master]
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.state.{kind}.{name}"] = state[kind].detach().clone()
    return out


def dump_full(engine, stream, path: str, rank: int, restored, zero3_weights: bool) -> None:
    """full_state (collective) to `path` and the counters a resume must carry to `path`.json, from rank 0."""
    full = full_state(engine, zero3_weights)
    if rank == 0:
        torch.save(full, path)
        with open(f"{path}.json", "w") as f:
            json.dump({**counters(engine, stream.position), "restored": restored.tier if restored else None}, f)


def train_step(engine, stream) -> float:
    """One optimizer step on the stream's next batch; the loss, averaged over the ranks."""
    import deepspeed

    x, y = (t.to(engine.device) for t in stream.next())
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()  # inmem_ft snapshots here every `interval` steps
    mean = loss.detach().float().clone()
    deepspeed.comm.all_reduce(mean)
    return mean.item() / deepspeed.comm.get_world_size()


def ds_config(stage: int, dtype: str, interval: int, micro_batch: int = MICRO_BATCH, accumulation: int = 1) -> dict:
    conf = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "inmem_ft": {"enabled": True, "interval": interval},
    }
    if dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    if torch.cuda.is_available():
        conf["optimizer"]["params"]["fused"] = True  # torch's fused AdamW kernel, what GPU jobs run
    return conf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", help="DeepSpeed JSON (e.g. `inmem-ft example-config deepspeed`); default: built in")
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=None,
                   help="train every DP layout on the same global batches of this many sequences (GlobalBatches)")
    p.add_argument("--reshard", default=None, choices=["auto", "never"], help="the inmem_ft block's reshard")
    p.add_argument("--load-dir", default=None, help="with --no-inmem: stock load_checkpoint from here first")
    p.add_argument("--dump-state", default=None, help="after restore/load: write each rank's state digest to "
                                                      "PATH.rank<r>")
    p.add_argument("--dump-weights", action="store_true", help="with --dump-full: ZeRO-3's module weights too")
    add_run_args(p, dump_help="rank 0 writes every global parameter and optimizer moment (torch.save) to PATH, "
                              "and the counters (steps, scheduler, data position) to PATH.json, at the end or "
                              "after --dump-step")
    args = parse(p)

    deepspeed = start()
    from inmem_ft.integrations.deepspeed import install

    rank = deepspeed.comm.get_rank()
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        config.setdefault("inmem_ft", {})["interval"] = args.interval
    else:
        world = deepspeed.comm.get_world_size()
        micro = args.global_batch // world if args.global_batch else MICRO_BATCH
        config = ds_config(args.zero_stage, args.dtype, args.interval, micro)
    if args.reshard:
        config["inmem_ft"]["reshard"] = args.reshard
    if args.no_inmem:
        config.pop("inmem_ft", None)

    torch.manual_seed(0)
    model = GPT(args.layers, args.hidden, dropout=args.dropout)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seed = 1234 + 17 * rank  # per-rank dropout masks and noise
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    stream = GlobalBatches(1234, args.global_batch, rank, deepspeed.comm.get_world_size()) if args.global_batch \
        else TokenStream(1234, rank)

    # The one inmem_ft line: snapshots every `interval` steps, restore of the newest tier on start.
    handle = install(engine, extra_state=lambda: {"position": stream.position})
    restored = handle.restored if handle is not None else None
    first = resume(handle, stream)
    corrupt.after_step(engine.basic_optimizer, rank, lambda: engine.global_steps + 1)  # counted after its step
    if restored is None and args.load_dir:  # plain DeepSpeed: a stock checkpoint (an earlier run's --save-dir)
        path, _ = engine.load_checkpoint(args.load_dir)
        assert path is not None, f"nothing to load in {args.load_dir}"
        first = engine.global_steps
        stream.position = first

    if args.dump_state:
        with open(f"{args.dump_state}.rank{rank}", "w") as f:
            f.write(json.dumps({"step": first, "digest": state_digest(engine)}))
    if args.dump_full and args.dump_step == first:
        dump_full(engine, stream, args.dump_full, rank, restored, args.dump_weights)
    for step in range(first + 1, args.steps + 1):
        inmem_ft.report_loss(step, train_step(engine, stream), args.loss_log)
        if args.dump_full and args.dump_step == step:
            dump_full(engine, stream, args.dump_full, rank, None, args.dump_weights)
        die_if_asked(args, step, rank, handle)
    finish(args, engine, handle)
    if args.dump_full and args.dump_step is None:
        dump_full(engine, stream, args.dump_full, rank, None, args.dump_weights)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)  # the process groups are destroyed on every path, an exception's too (issue 23)
