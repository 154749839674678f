"""An FSDP2 (fully_shard) training loop protected by inmem_ft through torch.distributed.checkpoint.

Run it under torchrun (or `inmem-ft launch`) with an SMP per node. Every `--interval` steps each rank's
shards go into its node's SMP through DCP (inmem_ft.dcp.Checkpointer); after a crash the restarted ranks
load them back from memory, on the same or another world size, with DCP's own resharding planner.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import inmem_ft
from inmem_ft.dcp import Checkpointer


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--hsdp", type=int, default=0, help="HSDP with this many replicas (default: plain FSDP)")
    p.add_argument("--loss-log", default=None, help="JSON lines of (step, loss) (default: $INMEM_FT_LOSS_LOG)")
    p.add_argument("--die-at", type=int, default=None, help="SIGKILL rank --die-rank after this step")
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument("--stock-dir", default=None, help="at the end: also save model and optimizer with stock DCP "
                                                     "(FileSystemWriter) into this directory, for comparisons")
    args = p.parse_args()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args.die_at = None

    inmem_ft.log_to_stderr()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(args.width, args.hsdp)
    torch.manual_seed(1 + rank)  # per-rank dropout masks
    data = DataPosition()
    ckpt = Checkpointer(None, args.interval, model, opt, scheduler=sched, extra_state={"data": data},
                        async_save=args.async_save)
    start = ckpt.restore() or 0

    for step in range(start + 1, args.steps + 1):
        x, y = batch(data.next, rank)
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
        if step == args.die_at and rank == args.die_rank:
            ckpt.wait()
            ckpt.snap.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if args.stock_dir:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=args.stock_dir)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
