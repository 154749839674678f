"""Plain DeepSpeed, no inmem_ft: a ZeRO-2 checkpoint through DeepSpeed's own ds_to_universal and back, compared with
what was saved (fp32 masters, weights, Adam moments). It tells a DeepSpeed release's universal loader from the
adapter's export (docs/compatibility.md: DeepSpeed 0.17.6 and 0.18.9 do not give the fp32 masters back).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/compat/plain_universal_roundtrip.py save DIR
    python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/global_step3 \\
        --output_folder DIR/global_step3_universal && echo global_step3_universal > DIR/latest_universal
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/compat/plain_universal_roundtrip.py load DIR"""
import sys

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

phase, where = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
if phase == "load":
    config["checkpoint"] = {"load_universal": True}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def state() -> dict:
    out = {}
    for name, param in engine.module.named_parameters():
        out[f"fp32.{name}"] = safe_get_full_fp32_param(param).clone()
        out[f"weight.{name}"] = param.detach().float().clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}.{name}"] = safe_get_full_optimizer_state(param, kind).clone()
    return out


if phase == "save":
    for _ in range(3):
        loss = engine(torch.randn(2, 16)).pow(2).mean()
        engine.backward(loss)
        with torch.no_grad():  # DeepSpeed 0.18's ZeRO-2 step fails on gloo otherwise (plain_zero_step.py)
            engine.step()
    engine.save_checkpoint(where, client_state={"universal_checkpoint_info": {}})  # ds_to_universal asks for it
    saved = state()
    if torch.distributed.get_rank() == 0:
        torch.save(saved, f"{where}/truth.pt")
else:
    path, _ = engine.load_checkpoint(where)
    loaded = state()
    if torch.distributed.get_rank() == 0:
        truth = torch.load(f"{where}/truth.pt")
        print(f"DeepSpeed {deepspeed.__version__}: loaded {path}; not equal to what was saved: "
              f"{[k for k in truth if not torch.equal(truth[k], loaded[k])]} (of {len(truth)})")
torch.distributed.destroy_process_group()
