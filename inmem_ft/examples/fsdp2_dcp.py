"""An FSDP2 (fully_shard) training loop protected by inmem_ft through torch.distributed.checkpoint.

Run it under torchrun (or `inmem-ft launch`) with an SMP per node. Every `--interval` steps each rank's
shards go into its node's SMP through DCP (inmem_ft.dcp.Checkpointer); after a crash the restarted ranks
load them back from memory, on the same or another world size, with DCP's own resharding planner.

With --global-batch G every step trains global batch b of a fixed global order (row j of batch b is a pure
function of b and j), each of the W ranks its G / W consecutive rows: the loss is the mean over the G rows on any
world size, so under `inmem-ft run --nnodes MIN:MAX` a job that shrinks or grows keeps its global batch with
larger or smaller per-rank batches (on_shrink, globalbatch.py, where W does not divide G), and resumed from step
s on any world size it trains batch s + 1 next: no row is skipped or repeated in the global order (where
on_shrink "keep" had to change G, batch b has the new number of rows: the order then differs). Without it each
rank draws its own batch of 8 per step (the lost rank's rows are not trained after a shrink).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import inmem_ft
from inmem_ft.dcp import Checkpointer
from inmem_ft.examples.ds_common import add_failure_args, die_if_asked, parse


class DataPosition:
    """The loader's position, a DCP Stateful: the next batch to read."""

    def __init__(self):
        self.next = 1

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def batch(index: int, rank: int, size: int = 8):
    g = torch.Generator().manual_seed(1000 * index + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def global_rows(index: int, rows: range):
    """Rows `rows` of global batch `index` (module docstring): each row its own generator, so a rank's share
    is the same bytes whatever the world size."""
    x = torch.stack([torch.randn(32, generator=torch.Generator().manual_seed(1_000_003 * index + j)) for j in rows])
    return x, x.sum(dim=1, keepdim=True).sin()


def per_rank_rows(global_batch: int, world: int, on_shrink: str) -> int:
    """Rows each rank trains of a global batch (globalbatch.py: one-row micro-batches, computed at once)."""
    from inmem_ft.globalbatch import for_dp

    b = for_dp(global_batch, 1, world, on_shrink)
    if not b.kept:
        print(b.note(), flush=True)
    return b.accumulation


def build(width: int, hsdp: int = 0):
    """The model, FSDP2-sharded over all ranks, or with `hsdp` replicas (HSDP: a replicas x shards mesh)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (hsdp, dist.get_world_size() // hsdp), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    return model, opt, sched


def dump_if_asked(args, step: int, model, opt, sched, data) -> None:
    """--dump-full at --dump-step: every parameter and optimizer state, gathered whole (a collective), and the
    counters, for a test to compare the state right after a restore with the one the snapshot was taken of."""
    if args.dump_full is None or step != args.dump_step:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        flat = {f"model.{k}": v for k, v in model_sd.items()}
        for name, state in optim_sd["state"].items():
            flat.update({f"optimizer.{name}.{k}": v for k, v in state.items()})
        torch.save({"tensors": flat, "counters": {"step": step, "next_batch": data.next, "lr": sched.get_last_lr(),
                                                  "scheduler_epoch": sched.last_epoch}}, args.dump_full)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--hsdp", type=int, default=0, help="HSDP with this many replicas (default: plain FSDP)")
    p.add_argument("--loss-log", default=None, help="JSON lines of (step, loss) (default: $INMEM_FT_LOSS_LOG)")
    p.add_argument("--global-batch", type=int, default=None, help="train global batches of a fixed global order, "
                                                                  "this many rows each (module docstring)")
    p.add_argument("--on-shrink", default="keep", choices=["keep", "refuse"],
                   help="with --global-batch: where the world size does not divide it (globalbatch.py)")
    p.add_argument("--dump-full", default=None, help="rank 0 writes the full model and optimizer state dict "
                                                     "(torch.save) to PATH ({restart}: torch elastic's restart count)")
    p.add_argument("--dump-step", type=int, default=None,
                   help="with --dump-full: after this step, or right after the restore of it")
    add_failure_args(p)
    p.add_argument("--stock-dir", default=None, help="at the end: also save model and optimizer with stock DCP "
                                                     "(FileSystemWriter) into this directory, for comparisons")
    args = parse(p)

    inmem_ft.log_to_stderr()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(args.width, args.hsdp)
    torch.manual_seed(1 + rank)  # per-rank dropout masks
    data = DataPosition()
    ckpt = Checkpointer(None, args.interval, model, opt, scheduler=sched, extra_state={"data": data},
                        async_save=args.async_save)
    start = ckpt.restore() or 0
    rows = per_rank_rows(args.global_batch, world, args.on_shrink) if args.global_batch else 0
    if rank == 0:
        print(f"[example] world={world} global_batch={rows * world if rows else 'per-rank'} rows_per_rank={rows or 8} "
              f"next_batch={data.next}", flush=True)
    dump_if_asked(args, start, model, opt, sched, data)

    for step in range(start + 1, args.steps + 1):
        x, y = global_rows(data.next, range(rank * rows, (rank + 1) * rows)) if rows else batch(data.next, rank)
        data.next += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        inmem_ft.report_loss(step, loss.item() / world, args.loss_log)
        ckpt.maybe_save(step)
        dump_if_asked(args, step, model, opt, sched, data)
        if rank == args.die_rank and step in (args.die_at, args.lose_node_at):
            ckpt.wait()  # the async upload, then the snapshot's commit: which step survives is then fixed
            ckpt.snap.wait()
        die_if_asked(args, step, rank, ckpt)
    ckpt.close()
    if args.stock_dir:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=args.stock_dir)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
