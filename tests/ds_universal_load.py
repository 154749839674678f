"""Stand-alone: load a universal checkpoint with stock DeepSpeed ("load_universal": true) and compare every
parameter and Adam moment with a ground-truth file. Imports only torch and deepspeed, never inmem_ft, so it
shows that an export needs nothing of ours to load.

Run one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set and
DS_ACCELERATOR=cpu. The model is rebuilt from the checkpoint's own param_shapes (a module tree of bare
parameters), so any exported model loads. Rank 0 writes {checked, mismatched, global_steps, lr, ...} as JSON.

    python tests/ds_universal_load.py --load-dir DIR --zero-stage 3 --truth full.pt --result out.json
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn


def bare_model(param_shapes: list) -> nn.Module:
    root = nn.Module()
    for group in param_shapes:
        for name, shape in group.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))
    return root


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--load-dir", required=True)
    p.add_argument("--zero-stage", type=int, required=True)
    p.add_argument("--truth", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 70-120 s JIT build on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    with open(os.path.join(args.load_dir, "latest_universal")) as f:
        tag = f.read().strip()
    states = torch.load(os.path.join(args.load_dir, tag, "mp_rank_00_model_states.pt"), weights_only=False)
    model = bare_model(states["param_shapes"])
    config = dict(states["ds_config"])  # the source's optimizer, scheduler and batch settings
    config.pop("inmem_ft", None)
    config["zero_optimization"] = {"stage": args.zero_stage}
    config["checkpoint"] = {"load_universal": True}
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * int(os.environ["WORLD_SIZE"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, _ = engine.load_checkpoint(args.load_dir)
    assert path is not None, f"nothing loaded from {args.load_dir}"

    truth = torch.load(args.truth, weights_only=True)
    checked, mismatched = 0, []
    for name, param in engine.module.named_parameters():
        got = {f"optimizer.state.fp32_param.{name}": safe_get_full_fp32_param(param)}
        for kind in ("exp_avg", "exp_avg_sq"):
            got[f"optimizer.state.{kind}.{name}"] = safe_get_full_optimizer_state(param, kind)
        if args.zero_stage < 3 and name in truth:  # the truth of a ZeRO-3 source has no plain weights
            got[name] = param.detach()
        for key, value in got.items():  # collectives above run on every rank; rank 0 compares
            checked += 1
            if key not in truth or value is None or not torch.equal(value.to(truth[key].dtype), truth[key]):
                mismatched.append(key)
    step = [s["step"] for s in engine.optimizer.optimizer.state.values() if "step" in s]
    if int(os.environ["RANK"]) == 0:
        with open(args.result, "w") as f:
            json.dump({"checked": checked, "mismatched": mismatched, "global_steps": engine.global_steps,
                       "global_samples": engine.global_samples, "lr": engine.get_lr(),
                       "optimizer_steps": sorted({float(s) for s in step}),
                       "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                       "imported_inmem_ft": any(m.split(".")[0] == "inmem_ft" for m in sys.modules)}, f)



if __name__ == "__main__":
    # Plain DeepSpeed, no inmem_ft (not even inmem_ft.teardown.run_main, which this mirrors): the process groups
    # are destroyed on every path, an exception's too, and after the traceback has let its frames go (issue 23).
    code = 0
    try:
        main()
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
