"""Stand-alone: load a universal checkpoint with stock DeepSpeed ("load_universal": true) and compare every
parameter and Adam moment with a ground-truth file. Imports only torch and deepspeed, never inmem_ft, so it
shows that an export needs nothing of ours to load.

Run one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set and
DS_ACCELERATOR=cpu. The model is rebuilt from the checkpoint's own param_shapes (a module tree of bare
parameters), so any exported model loads. Rank 0 writes {checked, mismatched, global_steps, lr, ...} as JSON.

    python tests/ds_universal_load.py --load-dir DIR --zero-stage 3 --truth full.pt --result out.json

With --pp N the model is a PipelineModule of N stages whose layers are bare modules with the parameters
DeepSpeed named `<layer index>.<name>` in the checkpoint, and `--tied KEY=I,J` a TiedLayerSpec at layers I and J
(its parameters are `tied_modules.KEY.<name>`); the truth is keyed as inmem_ft's shard map keys a pipeline,
`layer_XX.<name>` (a tied parameter at its first layer). With --tp N (and --pp) the model is the TP example's
PipelineModule and mpu (inmem_ft/examples/deepspeed_tp.py: model code, none of inmem_ft's snapshot code), and each
rank compares its tensor-parallel slice of the truth's global tensors.
"""
import argparse
import glob
import json
import os
import sys

import torch
import torch.nn as nn


# What `import inmem_ft` (for the example's model code) loads itself: the watch that says an "inmem_ft" block
# nobody installed (no framework, no snapshot code).
PACKAGE_IMPORT = {"inmem_ft.integrations", "inmem_ft.integrations.block_watch"}


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


class Bare(nn.Module):
    def __init__(self, shapes: dict):
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))

    def forward(self, x):
        return x


def bare_pipeline(load_dir: str, tag: str, stages: int, tied: dict[str, list[int]]):
    """(PipelineModule, DeepSpeed's parameter name -> the truth's key) from every stage's param_shapes."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    shapes = {}
    for path in sorted(glob.glob(os.path.join(load_dir, tag, "mp_rank_*_model_states.pt"))):
        for group in torch.load(path, weights_only=False)["param_shapes"]:
            shapes.update(group)
    layers: dict[int, dict] = {}
    tied_shapes: dict[str, dict] = {}
    for name, shape in shapes.items():
        head, rest = name.split(".", 1)
        if head == "tied_modules":
            key, rest = rest.split(".", 1)
            tied_shapes.setdefault(key, {})[rest] = shape
        else:
            layers.setdefault(int(head), {})[rest] = shape
    at = {i: key for key, where in tied.items() for i in where}
    specs = [TiedLayerSpec(at[i], Bare, tied_shapes[at[i]]) if i in at else LayerSpec(Bare, layers[i])
             for i in range(max([*layers, *at]) + 1)]

    return PipelineModule(specs, num_stages=stages, partition_method="uniform"), layer_keys(tied)


def layer_keys(tied: dict[str, list[int]]):
    """DeepSpeed's pipeline parameter name -> the truth's key."""
    def key_of(name: str) -> str:
        head, rest = name.split(".", 1)
        if head == "tied_modules":
            key, rest = rest.split(".", 1)
            return f"layer_{min(tied[key]):02d}.{rest}"
        return f"layer_{int(head):02d}.{rest}"

    return key_of


def tp_pipeline(tag_dir: str, stages: int, tp: int, states: dict):
    """(the example's TP GPT (inmem_ft/examples/deepspeed_tp.py, its model code only) in `stages` x `tp`, its
    width and depth read from the checkpoint, key_of, its mpu)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's example
    from inmem_ft.examples.deepspeed_tp import ModelParallelUnit, pipeline

    world = int(os.environ["WORLD_SIZE"])
    mpu = ModelParallelUnit(PipeModelDataParallelTopology(stages, tp, world // (stages * tp)))
    hidden = {n: s for group in states["param_shapes"] for n, s in group.items()}["1.pos.weight"][1]
    layers = len(glob.glob(os.path.join(tag_dir, "zero", "*.qkv.weight")))
    return pipeline(layers, hidden, 4, 0.0, mpu), layer_keys({"embed": [0, layers + 3]}), mpu


def local(param, full: torch.Tensor, mpu) -> torch.Tensor:
    """This tensor-parallel rank's slice of `full`, as the example's layers cut it."""
    if mpu is None or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(mpu.get_tensor_model_parallel_world_size(), param.partition_dim)[
        mpu.get_tensor_model_parallel_rank()]


def flat_fp32_master(engine, param) -> torch.Tensor:
    """`param`'s fp32 master as ZeRO-1/2's step reads and updates it: this rank's fragment of the optimizer's flat
    fp32 partition, all-reduced over the data-parallel group (what safe_get_full_fp32_param gathers)."""
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    mapping = param._hp_mapping
    if mapping is not None:
        flat = engine.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
        at, to = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, to.start, to.numel).copy_(flat.narrow(0, at.start, at.numel))
    torch.distributed.all_reduce(full, group=param._dp_group)
    return full.view_as(param)


def fp32_master(engine, param) -> torch.Tensor:
    """`param`'s fp32 master. Before DeepSpeed 0.19, a ZeRO-1/2 universal load leaves safe_get_full_fp32_param
    reading the wrong buffer (its map_to_flat_opt_states points each parameter's fp32 fragment at a flattened
    Adam moment), while the masters the optimizer steps from load right (tests/compat/plain_universal_roundtrip.py):
    there, read those."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from packaging.version import Version

    if Version(deepspeed.__version__).release < (0, 19) and hasattr(engine.optimizer, "single_partition_of_fp32_groups"):
        return flat_fp32_master(engine, param)
    return safe_get_full_fp32_param(param)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--load-dir", required=True)
    p.add_argument("--zero-stage", type=int, required=True)
    p.add_argument("--truth", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--pp", type=int, default=0, help="load into a PipelineModule of this many stages")
    p.add_argument("--tp", type=int, default=0, help="load into the TP example's PipelineModule (--pp stages) at "
                                                     "this tensor-parallel size")
    p.add_argument("--tied", action="append", default=[], help="KEY=I,J: a tied layer at layers I and J (with --pp)")
    args = p.parse_args()
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_optimizer_state

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 70-120 s JIT build on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    with open(os.path.join(args.load_dir, "latest_universal")) as f:
        tag = f.read().strip()
    states = torch.load(os.path.join(args.load_dir, tag, "mp_rank_00_model_states.pt"), weights_only=False)
    mpu = None
    if args.tp:
        model, key_of, mpu = tp_pipeline(os.path.join(args.load_dir, tag), args.pp, args.tp, states)
    elif args.pp:
        tied = {k: [int(i) for i in v.split(",")] for k, v in (t.split("=") for t in args.tied)}
        model, key_of = bare_pipeline(args.load_dir, tag, args.pp, tied)
    else:
        model, key_of = bare_model(states["param_shapes"]), str
    config = dict(states["ds_config"])  # the source's optimizer, scheduler and batch settings
    config.pop("inmem_ft", None)
    config["zero_optimization"] = {"stage": args.zero_stage}
    config["checkpoint"] = {"load_universal": True}
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config.get("gradient_accumulation_steps", 1)
                                  * int(os.environ["WORLD_SIZE"]) // (max(args.pp, 1) * max(args.tp, 1)))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    path, _ = engine.load_checkpoint(args.load_dir)
    assert path is not None, f"nothing loaded from {args.load_dir}"

    truth = torch.load(args.truth, weights_only=True)
    checked, mismatched = [], []
    for name, param in engine.module.named_parameters():
        key = key_of(name)
        got = {f"optimizer.state.fp32_param.{key}": fp32_master(engine, param)}
        for kind in ("exp_avg", "exp_avg_sq"):
            got[f"optimizer.state.{kind}.{key}"] = safe_get_full_optimizer_state(param, kind)
        if args.zero_stage < 3 and key in truth:  # the truth of a ZeRO-3 source has no plain weights
            got[key] = param.detach()
        for key, value in got.items():  # collectives above run on every rank of the stage
            checked.append(key)
            if key not in truth or value is None or not torch.equal(value.to(truth[key].dtype),
                                                                    local(param, truth[key], mpu)):
                mismatched.append(key)
    if args.pp or args.tp:  # each rank checked its own stage's layers (a tied one on each stage holding it)
        everyone = [None] * int(os.environ["WORLD_SIZE"])
        torch.distributed.all_gather_object(everyone, (checked, mismatched))
        checked = sorted({k for c, _ in everyone for k in c})
        mismatched = sorted({k for _, m in everyone for k in m})
    step = [s["step"] for s in engine.optimizer.optimizer.state.values() if "step" in s]
    if int(os.environ["RANK"]) == 0:
        with open(args.result, "w") as f:
            json.dump({"checked": len(checked), "checked_keys": checked, "mismatched": mismatched,
                       "global_steps": engine.global_steps,
                       "global_samples": engine.global_samples, "lr": engine.get_lr(),
                       "optimizer_steps": sorted({float(s) for s in step}),
                       "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                       "imported_inmem_ft": any(m.split(".")[0] == "inmem_ft" for m in sys.modules),
                       "imported_inmem_ft_beyond_examples": sorted(
                           m for m in sys.modules if m.startswith("inmem_ft.")
                           and m.split(".")[1] not in ("examples", "errors", "_lazy", "_version")
                           and m not in PACKAGE_IMPORT)}, f)



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
