"""Test-only: lets megatron-core 0.17.1, 0.18.2 and 0.19.2 train on a CPU-only machine (gloo, --transformer-impl local).

Import it before anything imports megatron. Megatron assumes CUDA everywhere (factory calls with
device='cuda' or torch.cuda.current_device(), .cuda(), CUDA RNG states, streams, events); this module
maps all of that onto the CPU. It is the recipe of shared/MEGATRON.md, section "The CPU shim". Where CUDA is
present install() steps aside (patches nothing), so the same tests run Megatron on the GPU as it is, on its
local layers (--transformer-impl local: Transformer Engine is not needed). Nothing in inmem_ft imports it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
import typing

import torch

_installed = False


def _cpu(device):
    """A device argument as the CPU when it names CUDA (a string, a torch.device or a bare index)."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapped


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
              "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "as_tensor",
              "empty_strided", "linspace", "eye", "frombuffer")


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        args = tuple(_cpu(a) if not isinstance(a, (torch.dtype, torch.Tensor)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return orig(self, *args, **kwargs)

    return to


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig(self, *args, **kwargs)
        # clip_grads.py asserts that grads are torch.cuda.FloatTensor
        return orig(self).replace("torch.", "torch.cuda.", 1)

    return type_


class _Dummy:
    """Stands in for streams, events and device contexts: every method is a no-op."""

    def __init__(self, *a, **kw):
        pass

    def __getattr__(self, name):
        return lambda *a, **kw: 0.0 if name == "elapsed_time" else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_cuda() -> None:
    c = torch.cuda
    c.is_available = lambda: True
    c.is_initialized = lambda: True
    c.device_count = lambda: 1
    c.current_device = lambda: 0
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "init", "_lazy_init",
                 "reset_max_memory_allocated", "memory._record_memory_history"):
        if "." not in name:
            setattr(c, name, lambda *a, **kw: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(c, name, lambda *a, **kw: 0)
    c.memory_stats = lambda *a, **kw: {}
    c.mem_get_info = lambda *a, **kw: (0, 0)
    c.get_device_properties = lambda *a, **kw: types.SimpleNamespace(
        name="cpu-shim", total_memory=0, major=9, minor=0, multi_processor_count=1, gcnArchName="")
    c.get_device_capability = lambda *a, **kw: (9, 0)
    c.get_device_name = lambda *a, **kw: "cpu-shim"
    c.Stream = c.Event = _Dummy
    c.current_stream = c.default_stream = lambda *a, **kw: _Dummy()
    c.stream = lambda *a, **kw: contextlib.nullcontext()
    # A CUDA build of torch (2.6's optimizers check it at every step) would ask the absent driver.
    c.is_current_stream_capturing = c.graphs.is_current_stream_capturing = lambda: False
    c.device = _Dummy
    # CUDA RNG -> the CPU generator (Megatron's trackers swap CUDA states around every dropout region)
    c.get_rng_state = lambda *a, **kw: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **kw: torch.set_rng_state(state)
    c.get_rng_state_all = lambda: [torch.get_rng_state()]
    c.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    # not torch.manual_seed: that calls torch.cuda.manual_seed_all itself
    c.manual_seed = c.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state


def _patch_tensors() -> None:
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _redirect_device(getattr(torch, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = lambda self, *a, **kw: self
    torch.Tensor.pin_memory = lambda self, *a, **kw: self
    torch.Tensor.record_stream = lambda self, *a, **kw: None
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.nn.Module.cuda = lambda self, *a, **kw: self


def _patch_data_loader() -> None:
    """On a GPU, dropout draws from the CUDA generator and a DataLoader's seed draw (each new iterator) from the
    CPU one. Here both are the CPU generator, so a resumed run, which builds its data iterator after loading
    the RNG states, would shift every dropout mask by that one draw. Loaders get a generator of their own,
    as the two streams are separate on a GPU."""
    init = torch.utils.data.DataLoader.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(0)
        init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = __init__


# The modules that define the MoE paged-stash kernels (0.18: with the stash's Python code; 0.19: on their own)
# import triton at module level, and the modules every GPT imports import them. A GPT without MoE never runs them.
_TRITON_KERNEL_MODULES = ("megatron.core.transformer.moe.paged_stash", "megatron.core.transformer.moe.ops.paged_stash")
_TRITON_IMPORTS = re.compile(r"^import triton(?:\.language as tl)?$", re.M)


class _Kernel:
    """A @triton.jit kernel without triton: defined, but launching it says why it cannot run."""

    def __init__(self, fn):
        self.name = fn.__name__

    def __getitem__(self, grid):
        raise RuntimeError(f"megatron_cpu_shim: {self.name} is a triton kernel (MoE paged stash): not on the CPU")


_TRITON = types.SimpleNamespace(jit=_Kernel, language=types.SimpleNamespace(constexpr=object))


class _KernelsWithoutTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads the modules above with a stand-in triton (jit and tl.constexpr, all their definitions need) given to
    them alone: the rest of Megatron still finds no triton and takes its paths without it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TRITON_KERNEL_MODULES or importlib.util.find_spec("triton") is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(module.__spec__.origin) as f:
            source = _TRITON_IMPORTS.sub("pass", f.read())  # same line numbers in tracebacks
        module.triton, module.tl = _TRITON, _TRITON.language
        exec(compile(source, module.__spec__.origin, "exec"), module.__dict__)


def _stand_in_modules() -> None:
    if not hasattr(typing, "override"):  # megatron.training.models uses the Python 3.12 decorator
        typing.override = lambda f: f
    sys.meta_path.insert(0, _KernelsWithoutTriton())


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # graph_safe: the cudagraphable tracker (Transformer Engine's shape) holds torch.Generator objects. CPU
    # generators have no graphsafe_get_state; a clone of the CPU generator's state, set back by value, is what
    # the tracker's fork() sees of CUDA's (it reads the state after the region and sets the saved one back).
    mrandom._get_cuda_rng_state = lambda *a, clone=False, graph_safe=False, **kw: (
        torch.default_generator.clone_state() if graph_safe else torch.get_rng_state())
    mrandom._set_cuda_rng_state = lambda state, *a, graph_safe=False, **kw: torch.set_rng_state(
        state.get_state() if graph_safe else state)
    if not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):  # the tracker asserts torch has it
        torch.cuda.CUDAGraph.register_generator_state = lambda self, generator: None
    import megatron.core.datasets.utils as dutils

    dutils.compile_helpers = lambda: None  # rank 0 would run `make`; the wheel ships no Makefile


def install() -> None:
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():  # Megatron's own CUDA paths run as they are
        return
    if "megatron" in sys.modules:
        raise RuntimeError("install megatron_cpu_shim before anything imports megatron")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # Megatron's jit_fuser is torch.compile
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args asserts it for TP
    from torch._dynamo import config as dynamo_config

    dynamo_config.disable = True
    _stand_in_modules()
    _patch_cuda()
    _patch_tensors()
    _patch_data_loader()
    _patch_megatron()
    _installed = True
