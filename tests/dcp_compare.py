"""A rank of a job on any world size: load the FSDP2 example's newest in-memory DCP snapshot (inmem_ft.dcp)
into one fresh model and optimizer and a stock DCP checkpoint (FileSystemReader) into another, and have rank 0
write which full tensors (parameters, Adam moments) differ.

    python tests/dcp_compare.py --stock DIR --result out.json [--width N]
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from inmem_ft.dcp import Checkpointer
from inmem_ft.examples.fsdp2_dcp import build


def full(model, opt) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in model_sd.items()}
    for name, moments in optim_sd["state"].items():
        out.update({f"optimizer.{name}.{k}": v for k, v in moments.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stock", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    dist.init_process_group("gloo")
    model, opt, _ = build(args.width)
    ckpt = Checkpointer(None, 1, model, opt)
    step = ckpt.restore()
    line = ckpt.last_restore.source
    ckpt.close()
    stock_model, stock_opt, _ = build(args.width)
    model_sd, optim_sd = get_state_dict(stock_model, stock_opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=args.stock)
    set_state_dict(stock_model, stock_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    ours, theirs = full(model, opt), full(stock_model, stock_opt)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"step": step, "source": line, "world": dist.get_world_size(), "keys": sorted(ours),
                       "mismatched": sorted(k for k in theirs if k not in ours or not torch.equal(ours[k], theirs[k]))},
                      f)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
