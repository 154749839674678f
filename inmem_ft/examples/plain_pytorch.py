"""A plain torch.distributed training loop protected by inmem_ft: the README's runnable example.

Run it under torchrun (or `inmem-ft launch`) with an SMP per node. Every `--interval` steps each rank
snapshots its state into the node's SMP; after a crash the restarted ranks resume from memory, and the
loss trajectory is bit-identical to a run that never failed.
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import inmem_ft
from inmem_ft.examples import corrupt
from inmem_ft.snapshot import annotate


def batch(step: int, rank: int, size: int = 16):
    # The data position is the step: batch `step` of rank `rank` is always the same tensor.
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_state(model, opt, sched, rank: int, dp_split: bool) -> dict:
    """Model and optimizer with shard specs, so inspectors and resharding loaders know each tensor's place.
    Replicas that each store their full state mark only rank 0's copy as the one to read."""
    main = dp_split or rank == 0
    model_sd, opt_sd = annotate.model_and_optimizer(model, opt, main=main, replica=() if dp_split else (rank,))
    return {"model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--loss-log", default=None, help="JSON lines of (step, loss) (default: $INMEM_FT_LOSS_LOG)")
    p.add_argument("--die-at", type=int, default=None,
                   help="failure injection: SIGKILL self after this step (first torchrun attempt only)")
    p.add_argument("--die-rank", type=int, default=0, help="the rank --die-at or --hang-at acts on")
    p.add_argument("--hang-at", type=int, default=None,
                   help="failure injection: SIGSTOP self after this step, and stay there once continued (first torchrun "
                        "attempt only): a hung rank")
    p.add_argument("--dp-split", action="store_true",
                   help="replicas store only their share of the (replicated) model and optimizer")
    p.add_argument("--overlap", action="store_true", help="copy behind the next forward/backward")
    p.add_argument("--fingerprint-every", type=int, default=None,
                   help="with --dp-split: compare the replicas' fingerprints every this many snapshots (0: never)")
    p.add_argument("--dump-full", default=None, help="at the end: rank 0 writes every parameter and optimizer "
                                                     "tensor under its shard-map key (torch.save) to PATH")
    args = p.parse_args()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args.die_at = args.hang_at = None  # torchrun restarted us after the injected failure: do not fail again

    inmem_ft.log_to_stderr()  # snapshot and restore lines in each rank's log
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    torch.manual_seed(1 + rank)  # per-rank dropout masks

    every = {} if args.fingerprint_every is None else {"fingerprint_every": args.fingerprint_every}
    snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=args.interval, **every),
                                dp_group=dist.group.WORLD if args.dp_split else None)
    shared = inmem_ft.Replicated if args.dp_split else (lambda tree: tree)
    if args.overlap:
        snap.fence_optimizer(opt)  # the snapshot copy overlaps forward/backward, never the optimizer step
    start = 0
    state = snap.restore()
    if state is not None:
        model.load_state_dict(state["train"]["model"])
        opt.load_state_dict(state["train"]["optimizer"])
        sched.load_state_dict(state["train"]["scheduler"])
        inmem_ft.restore_rng_state(state["rng"])
        start = state["step"]
    corrupt.after_step(opt, rank, lambda: step)
    corrupt.flip_after_step(opt, rank, lambda: step)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        sched.step()
        dist.all_reduce(loss)
        inmem_ft.report_loss(step, loss.item() / world, args.loss_log)
        snap.observe(step, loss / world)  # the first steps after a restore are screened (issue 40)
        snap.maybe_save(step, lambda: {"train": shared(train_state(model, opt, sched, rank, args.dp_split)),
                                       "rng": inmem_ft.capture_rng_state(), "step": step},
                        overlap=args.overlap)
        if step in (args.die_at, args.hang_at) and rank == args.die_rank:
            snap.wait()  # which snapshot survives is then fixed; tests/test_failures.py kills mid-write
            os.kill(os.getpid(), signal.SIGKILL if step == args.die_at else signal.SIGSTOP)
            while step == args.hang_at:  # a hang stays one: the SIGCONT that lets it print its stacks ends none
                time.sleep(1)
    snap.close()
    if args.dump_full and rank == 0:
        model_sd, opt_sd = annotate.model_and_optimizer(model, opt)
        leaves = [*model_sd.values(), *(v for s in opt_sd["state"].values() for v in s.values())]
        torch.save({x.specs[0].key: x.tensor.clone() for x in leaves if isinstance(x, inmem_ft.Sharded)},
                   args.dump_full)



if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)  # the process groups are destroyed on every path, an exception's too (issue 23)
