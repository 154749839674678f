"""Plain DeepSpeed, no inmem_ft: a few ZeRO steps of a small MLP on CPU with gloo. It tells a DeepSpeed release's
own failure from the adapter's (docs/compatibility.md: DeepSpeed 0.18.9's ZeRO-1/2 step fails here too).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/compat/plain_zero_step.py STAGE [fp32|bf16]"""
import sys

import deepspeed
import torch

stage = int(sys.argv[1]) if len(sys.argv) > 1 else 1
dtype = sys.argv[2] if len(sys.argv) > 2 else "fp32"
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": stage}}
if dtype == "bf16":
    config["bf16"] = {"enabled": True}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(3):
    x = torch.randn(2, 16, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
print(f"rank {torch.distributed.get_rank()}: ZeRO-{stage} {dtype}, DeepSpeed {deepspeed.__version__}, "
      f"torch {torch.__version__}: 3 steps")
