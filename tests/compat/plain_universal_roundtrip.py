"""Plain DeepSpeed, no inmem_ft: a ZeRO-1/2 checkpoint through DeepSpeed's own ds_to_universal and back, compared with
what was saved (fp32 masters, weights, Adam moments), then one more step compared with the step the saving run took
after its save. It tells a DeepSpeed release's universal loader from the adapter's export (docs/compatibility.md:
after this load, the safe_get_full_fp32_param of DeepSpeed 0.16.9 and 0.17.6 reads a wrong buffer, while the fp32
masters the optimizer steps from, read from its flat partition, come back right).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/compat/plain_universal_roundtrip.py save DIR [STAGE]
    python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/global_step3 \\
        --output_folder DIR/global_step3_universal && echo global_step3_universal > DIR/latest_universal
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/compat/plain_universal_roundtrip.py load DIR [STAGE]

STAGE: the ZeRO stage of both runs, 1 or 2 (default 2)."""
import os
import sys

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds_universal_load import flat_fp32_master  # noqa: E402  (the stock loader's; it imports only torch and deepspeed)

phase, where = sys.argv[1], sys.argv[2]
stage = int(sys.argv[3]) if len(sys.argv) > 3 else 2
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
if phase == "load":
    config["checkpoint"] = {"load_universal": True}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def state() -> dict:
    out = {}
    for name, param in engine.module.named_parameters():
        out[f"fp32.{name}"] = safe_get_full_fp32_param(param).clone()
        out[f"flat fp32.{name}"] = flat_fp32_master(engine, param).clone()
        out[f"weight.{name}"] = param.detach().float().clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}.{name}"] = safe_get_full_optimizer_state(param, kind).clone()
    return out


def step(seed: int) -> None:
    torch.manual_seed(seed + torch.distributed.get_rank())
    loss = engine(torch.randn(2, 16)).pow(2).mean()
    engine.backward(loss)
    with torch.no_grad():  # DeepSpeed 0.18's ZeRO-1/2 step fails on gloo otherwise (plain_zero_step.py)
        engine.step()


def weights() -> dict:
    return {name: param.detach().float().clone() for name, param in engine.module.named_parameters()}


if phase == "save":
    for seed in range(3):
        step(seed)
    engine.save_checkpoint(where, client_state={"universal_checkpoint_info": {}})  # ds_to_universal asks for it
    saved = state()
    step(3)
    if torch.distributed.get_rank() == 0:
        torch.save({"saved": saved, "next": weights()}, f"{where}/truth.pt")
else:
    path, _ = engine.load_checkpoint(where)
    loaded = state()
    step(3)
    if torch.distributed.get_rank() == 0:
        truth = torch.load(f"{where}/truth.pt")
        print(f"DeepSpeed {deepspeed.__version__}, ZeRO-{stage}: loaded {path}; not equal to what was saved: "
              f"{[k for k in truth['saved'] if not torch.equal(truth['saved'][k], loaded[k])]} "
              f"(of {len(truth['saved'])}); weights after one more step not equal to the saving run's: "
              f"{[k for k, v in weights().items() if not torch.equal(truth['next'][k], v)]}")
torch.distributed.destroy_process_group()
