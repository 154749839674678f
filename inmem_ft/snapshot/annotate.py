"""Shard specs for whole (unsharded) tensors of a module and a torch optimizer: what a data-parallel or
single-device job saves. Framework adapters with sharded state build their own specs; these cover the
plain API and the whole-tensor parts of every framework.

Keys: the module's state-dict names; `optimizer.state.<kind>.<param name>` for per-parameter optimizer
tensors (Adam's exp_avg/exp_avg_sq, SGD's momentum_buffer). `main=False` marks a copy a loader need not
read (a data-parallel replica that stores its full state: only DP rank 0's copy is main).
"""
from __future__ import annotations

import torch

from .shardspec import ShardSpec
from .tree import Sharded


OPTIMIZER_STATE = "optimizer.state."


def optimizer_key(kind: str, name: str) -> str:
    return f"{OPTIMIZER_STATE}{kind}.{name}"


def whole(key: str, tensor: torch.Tensor, *, main: bool = True, replica: tuple[int, ...] = ()) -> Sharded:
    return Sharded(tensor, ShardSpec(key, tuple(tensor.shape), replica=replica, main=main))


def state_dict(sd: dict, *, main: bool = True, replica: tuple[int, ...] = (), prefix: str = "") -> dict:
    """A copy of a module state dict whose (non-empty) tensors carry their whole-tensor spec, keyed
    `prefix` + name."""
    out = type(sd)((name, whole(prefix + name, t, main=main, replica=replica)
                    if isinstance(t, torch.Tensor) and t.numel() else t) for name, t in sd.items())
    if hasattr(sd, "_metadata"):
        out._metadata = sd._metadata  # load_state_dict reads the per-module versions
    return out


def optimizer_state(osd: dict, names: dict[int, str], *, main: bool = True, replica: tuple[int, ...] = ()) -> dict:
    """A copy of a torch optimizer state_dict whose per-parameter tensors carry specs. The containers are
    copied: `Optimizer.state_dict()` hands out the optimizer's live per-parameter state dicts."""
    def entry(index, kind, value):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return whole(optimizer_key(kind, names[index]), value, main=main, replica=replica)
        return value  # scalars such as Adam's step

    out = dict(osd)
    out["state"] = {i: {kind: entry(i, kind, v) for kind, v in s.items()} for i, s in osd["state"].items()}
    return out


def param_names(module: torch.nn.Module, param_lists) -> dict[int, str]:
    """Optimizer parameter index -> module parameter name. `param_lists`: the optimizer's groups of
    parameters in order (e.g. [g["params"] for g in opt.param_groups]), as torch numbers them."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {i: names[id(p)] for i, p in enumerate(p for group in param_lists for p in group)}


def model_and_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, main: bool = True,
                        replica: tuple[int, ...] = ()) -> tuple[dict, dict]:
    """(module state dict, optimizer state dict), both with shard specs: the plain API's one call."""
    names = param_names(module, [g["params"] for g in optimizer.param_groups])
    return (state_dict(module.state_dict(), main=main, replica=replica),
            optimizer_state(optimizer.state_dict(), names, main=main, replica=replica))
