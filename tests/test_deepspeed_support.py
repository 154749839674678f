"""DeepSpeed layouts the adapter does not handle are refused at install(), not mis-saved (issue 11, item 10).
Real engines on CPU/gloo, in a subprocess (one process group per process)."""
import subprocess
import sys
import textwrap

from ds_harness import free_port
from inmem_ft import compat

BUILD = textwrap.dedent("""
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.pipe import PipelineModule
    from inmem_ft.errors import ConfigError
    from inmem_ft.integrations.deepspeed import cpu_setup, install, support

    cpu_setup()
    deepspeed.init_distributed(dist_backend="gloo")
    ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}

    def engine(model, **config):
        optimizer = None if "optimizer" in config else torch.optim.Adam(model.parameters())
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                    config={"train_micro_batch_size_per_gpu": 1, **config})[0]

    def refusal(engine, version=None):
        real, deepspeed.__version__ = deepspeed.__version__, version or deepspeed.__version__
        try:
            install(engine, config={"interval": 1})  # a refusal comes before the SMP is ever asked
            return "accepted"
        except ConfigError as e:
            return str(e)
        finally:
            deepspeed.__version__ = real

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=1)

    plain = engine(torch.nn.Linear(4, 4), optimizer=ADAM)
    support.check_supported(plain)  # the layout we handle passes
    support.check_supported(plain, version="0.19.9+abc1234")  # a source build of a patch release passes
    print("version:", refusal(plain, version="0.20.0"))
    def pipe():
        return PipelineModule([torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss())

    support.check_supported(engine(pipe(), optimizer=ADAM))  # a PipelineModule with ZeRO-0/1 passes
    print("pipeline_bf16:", refusal(engine(pipe(), optimizer=ADAM, bf16={"enabled": True})))

    class TensorParallel:  # an mpu as Megatron hands one to deepspeed.initialize, with 2 tensor-parallel ranks
        def get_tensor_model_parallel_world_size(self):
            return 2

    tp = engine(torch.nn.Linear(4, 4), optimizer=ADAM, zero_optimization={"stage": 3})
    tp.mpu = TensorParallel()
    print("tp:", refusal(tp))
    autotp = engine(torch.nn.Linear(4, 4), optimizer=ADAM)
    autotp.autotp_size = lambda: 2  # what "tensor_parallel": {"autotp_size": 2} gives (AutoTP needs 2 ranks)
    print("autotp:", refusal(autotp))
    print("moe:", refusal(engine(Experts(), optimizer=ADAM)))  # ZeRO-0
    support.check_supported(engine(Experts(), optimizer=ADAM, zero_optimization={"stage": 1}))  # MoE at ZeRO-1
    print("offload:", refusal(engine(torch.nn.Linear(4, 4), zero_force_ds_cpu_optimizer=False,
                                     zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})))
    from inmem_ft.teardown import run_main
    run_main(lambda: None)  # the gloo groups go before the interpreter finalizes (teardown.py)
""")


def test_unsupported_deepspeed_layouts_are_refused(runtime):
    out = subprocess.run([sys.executable, "-c", BUILD, str(free_port())], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.split(":")[0] in
                {"version", "pipeline_bf16", "tp", "autotp", "moe", "offload"})
    assert f"deepspeed 0.20.0 is not supported (tested: {compat.tested('deepspeed')})" in said["version"]
    assert "bf16 under a PipelineModule with ZeRO-0" in said["pipeline_bf16"]
    assert "tensor parallelism (size 2) under ZeRO-3 is not supported" in said["tp"]
    assert "DeepSpeed AutoTP training (tensor_parallel.autotp_size 2) is not supported" in said["autotp"]
    assert "mixture-of-experts layers are supported with ZeRO-1 and ZeRO-2, this engine runs ZeRO-0" in said["moe"]
    assert "optimizer offload to cpu is not supported" in said["offload"]
    assert all("\n" not in s for s in said.values())
    assert all("remove the inmem_ft block" in said[k] for k in ("version", "tp", "moe", "offload"))
