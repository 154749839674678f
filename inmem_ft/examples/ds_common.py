"""What every DeepSpeed example does alike: its common arguments, the CPU/gloo start, the resume of its data
position, the failure injection the tests use, and the end of the run. Each example keeps its own model, data
and training step."""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch

import inmem_ft


def add_run_args(p: argparse.ArgumentParser, *, hidden: int = 64, dump_help: str) -> None:
    """Precision, length, model size, plain-DeepSpeed mode, a stock checkpoint at the end, and the test hooks."""
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--no-inmem", action="store_true", help="plain DeepSpeed: drop the inmem_ft block")
    p.add_argument("--save-dir", default=None, help="at the end: engine.save_checkpoint(PATH), a stock DeepSpeed "
                                                    "checkpoint (inmem_ft's disk tier is the SMPs' business)")
    p.add_argument("--dump-full", default=None, help=dump_help)
    p.add_argument("--dump-step", type=int, default=None,
                   help="with --dump-full: after this step (or right after the restore of it)")
    p.add_argument("--loss-log", default=None, help="JSON lines of (step, loss) (default: $INMEM_FT_LOSS_LOG)")
    add_failure_args(p)


def add_failure_args(p: argparse.ArgumentParser) -> None:
    """The failure injection the tests use: every example that calls parse() and die_if_asked() has these."""
    p.add_argument("--die-at", type=int, default=None,
                   help="failure injection: SIGKILL self after this step (in the attempt --die-attempt names)")
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument("--die-attempt", type=int, default=0,
                   help="with --die-at or --lose-node-at: the attempt it applies to, as torch elastic counts restarts "
                        "(default: 0, the first; 1: the first restart, e.g. on the layout after a shrink)")
    p.add_argument("--lose-node-at", type=int, default=None,
                   help="failure injection: after this step, once the newest snapshot is protected, SIGKILL this "
                        "rank's node (its SMP, its agent, itself: --die-rank's; in the attempt --die-attempt names)")


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    args = p.parse_args()
    if getattr(args, "dump_full", None):  # one dump per attempt where the path asks (a shrink's restart dumps
        # the restore); the Hugging Face examples dump nothing
        args.dump_full = args.dump_full.replace("{restart}", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart != args.die_attempt:  # torchrun restarted us after the injected failure: not again
        args.die_at = args.lose_node_at = None
    return args


def start():
    """inmem_ft's log lines in each rank's log, one thread per rank (ranks share the cores; it also fixes the
    reduction order), DeepSpeed's CPU setup and gloo, or NCCL where the ranks have GPUs (benchmarks/gpu_check.py
    runs the examples there). Returns the deepspeed module."""
    inmem_ft.log_to_stderr()
    torch.set_num_threads(1)
    import deepspeed

    from inmem_ft.integrations.deepspeed import cpu_setup

    cpu_setup()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return deepspeed


def resume(handle, data) -> int:
    """The step to go on from: the restored one, with the data position the snapshot carried, or 0."""
    if handle is None or handle.restored is None:
        return 0
    data.position = handle.restored.extras["position"]
    return handle.restored.step


def die_if_asked(args: argparse.Namespace, step: int, rank: int, handle) -> None:
    """--die-at: SIGKILL this rank after `step`, once its snapshot is in (which snapshot survives is then fixed;
    tests/test_failures.py kills mid-write by other means)."""
    if step == args.die_at and rank == args.die_rank:
        if handle is not None:
            handle.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.lose_node_at and rank == args.die_rank:
        lose_node(handle)


def lose_node(handle, wait_s: float = 120.0) -> None:
    """A node's power loss, at a known step: once this rank's newest snapshot is in and its SMP's EC group has
    protected it (what the survivors rebuild is then fixed), SIGKILL the node's SMP, then the agent above this
    rank (`inmem-ft run`, before it can restart anything), then this rank. One rank per node."""
    from inmem_ft.smp import control

    handle.wait()
    socket, newest = handle.snap.config.socket_path, handle.snap.complete
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = control.call(socket, "status")
        if (status["ec"] or {}).get("protected_step") is not None and status["ec"]["protected_step"] >= newest:
            break
        time.sleep(0.05)
    os.kill(status["pid"], signal.SIGKILL)
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def finish(args: argparse.Namespace, engine, handle) -> None:
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if handle is not None:
        handle.close()


def counters(engine, position: int) -> dict:
    """What a resume carries besides the tensors, for the examples' --dump-full."""
    steps = sorted({float(s["step"]) for s in engine.basic_optimizer.state.values() if "step" in s})
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "optimizer_steps": steps, "lr": engine.get_lr(),
            "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None, "position": position}
