"""A training state (nested containers of tensors, arrays and plain values) <-> a JSON tree plus leaves.

Tensors and numpy arrays become numbered leaves whose bytes travel separately; everything else is encoded
in JSON with one-key tags, so decoding is a pure data walk: nothing is unpickled and nothing imported.
Python and numpy RNG states are plain tuples/arrays and ride along with no special case.
"""
from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import UnsafeType
from . import safe_types
from .shardspec import ShardSpec


class Sharded:
    """Marks a tensor with its shard spec(s): where its elements sit in global tensors. A flat buffer holding
    the shards of several keys carries one spec per key (each with its own `at`). Restore gives back the
    bare tensor."""

    __slots__ = ("tensor", "specs")

    def __init__(self, tensor: torch.Tensor, specs: "ShardSpec | list[ShardSpec] | tuple[ShardSpec, ...]"):
        self.tensor = tensor
        self.specs = (specs,) if isinstance(specs, ShardSpec) else tuple(specs)
        numel = tensor.numel() if isinstance(tensor, torch.Tensor) else int(tensor.size)
        for spec in self.specs:
            if spec.at + spec.numel > numel:
                raise ValueError(f"shard spec of {spec.key!r} covers elements [{spec.at}, {spec.at + spec.numel}) "
                                 f"of a stored tensor of {numel} elements")


class Replicated:
    """Marks a subtree that is identical on every rank of the data-parallel group.

    Each replica stores only its share of the subtree's bytes; restore gathers the shares back.
    """

    __slots__ = ("tree",)

    def __init__(self, tree: Any):
        self.tree = tree


@dataclass
class Leaf:
    value: Any  # torch.Tensor or np.ndarray, as captured (possibly on an accelerator)
    replicated: bool
    shards: tuple[ShardSpec, ...] = ()

    @property
    def is_array(self) -> bool:
        return isinstance(self.value, np.ndarray)

    @property
    def nbytes(self) -> int:
        v = self.value
        return int(v.nbytes) if self.is_array else v.numel() * v.element_size()

    @property
    def dtype_name(self) -> str:
        return self.value.dtype.str if self.is_array else str(self.value.dtype).removeprefix("torch.")


@dataclass
class FlatState:
    tree: Any
    leaves: list[Leaf] = field(default_factory=list)


def _key_is_plain(k) -> bool:
    return isinstance(k, str)


class _Flattener:
    def __init__(self):
        self.leaves: list[Leaf] = []
        self._seen: dict[int, int] = {}  # id(tensor) -> leaf index: tied weights are stored once
        self._replicated = False

    def leaf(self, value, shards=(), key=None) -> dict:
        # Keyed by the caller's object, which the state keeps alive, so ids cannot be recycled meanwhile.
        key = id(value) if key is None else key
        idx = self._seen.get(key)
        if idx is None:
            idx = len(self.leaves)
            self._seen[key] = idx
            self.leaves.append(Leaf(value, self._replicated, shards))
        return {"A" if isinstance(value, np.ndarray) else "T": idx}

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"f": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, Sharded):
            return self.tensor(obj.tensor, path, obj.specs)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise UnsafeType(f"{path}: numpy array of Python objects cannot be stored without pickle")
            return self.leaf(obj)
        if isinstance(obj, np.generic):
            return {"np": obj.dtype.str, "v": self.encode(obj.item(), path)}
        if isinstance(obj, Replicated):
            if self._replicated:
                return self.encode(obj.tree, path)
            self._replicated = True
            try:
                return {"R": self.encode(obj.tree, path)}
            finally:
                self._replicated = False
        if isinstance(obj, dict):
            return self.mapping(obj, path)
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {"tu": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, bytes):
            return {"b": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        return self.registered(obj, path)

    def tensor(self, t: torch.Tensor, path: str, shards=()) -> dict:
        if t.layout != torch.strided or t.is_quantized:
            raise UnsafeType(f"{path}: {t.layout} tensors are not supported; convert to a dense tensor first")
        return self.leaf(t.detach(), shards, key=id(t))

    def mapping(self, obj: dict, path: str) -> dict:
        ordered = type(obj) is OrderedDict
        if type(obj) not in (dict, OrderedDict):
            if not safe_types.is_registered(type(obj)):
                raise UnsafeType(f"{path}: dict subclass {type(obj).__qualname__} is not registered; "
                                 f"call inmem_ft.snapshot.register_safe_class({type(obj).__qualname__})")
        if all(_key_is_plain(k) for k in obj):
            out = {"od" if ordered else "d": {k: self.encode(v, f"{path}.{k}") for k, v in obj.items()}}
        else:
            out = {"dk": [[self.encode(k, f"{path}<key>"), self.encode(v, f"{path}[{k!r}]")]
                          for k, v in obj.items()], "o": ordered}
        # nn.Module.state_dict() carries per-module versions here; load_state_dict reads them.
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out["m"] = self.encode(dict(meta), f"{path}._metadata")
        return out

    def registered(self, obj: Any, path: str) -> dict:
        cls = type(obj)
        if not safe_types.is_registered(cls):
            raise UnsafeType(
                f"{path}: value of type {cls.__module__}.{cls.__qualname__} cannot be stored without pickle; "
                f"convert it to plain data, or allow it with inmem_ft.snapshot.register_safe_class("
                f"{cls.__qualname__}) if its __dict__ holds only data")
        name = safe_types.class_name(cls)
        if safe_types.is_enum(cls):
            return {"enum": name, "v": self.encode(obj.value, path)}
        return {"obj": name, "s": self.encode(dict(vars(obj)), path)}


def flatten(state: Any) -> FlatState:
    f = _Flattener()
    tree = f.encode(state, "state")
    return FlatState(tree, f.leaves)


def _decode(node: Any, leaves: list) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, leaves) for v in node]
    (tag, val), *rest = node.items()
    if tag in ("T", "A"):
        return leaves[val]
    if tag in ("d", "od"):
        out = (OrderedDict if tag == "od" else dict)((k, _decode(v, leaves)) for k, v in val.items())
        return _with_meta(out, rest, leaves)
    if tag == "dk":
        ordered = dict(rest)["o"]
        out = (OrderedDict if ordered else dict)((_decode(k, leaves), _decode(v, leaves)) for k, v in val)
        return _with_meta(out, rest[1:], leaves)
    if tag == "R":
        return _decode(val, leaves)
    if tag == "tu":
        return tuple(_decode(v, leaves) for v in val)
    if tag == "f":
        return float(val)
    if tag == "b":
        return base64.b64decode(val)
    if tag == "np":
        return np.dtype(val).type(_decode(dict(rest)["v"], leaves))
    if tag == "size":
        return torch.Size(val)
    if tag == "dtype":
        return dtype_from_name(val)
    if tag == "device":
        return torch.device(val)
    if tag == "enum":
        return safe_types.lookup(val)(_decode(dict(rest)["v"], leaves))
    if tag == "obj":
        cls = safe_types.lookup(val)
        obj = cls.__new__(cls)
        vars(obj).update(_decode(dict(rest)["s"], leaves))
        return obj
    raise ValueError(f"unknown manifest tag {tag!r}: snapshot written by a newer inmem_ft?")


def _with_meta(out, rest, leaves):
    for key, meta in rest:
        if key == "m":
            out._metadata = _decode(meta, leaves)
    return out


def unflatten(tree: Any, leaves: list) -> Any:
    """Rebuild the state; `leaves` holds the tensors/arrays in leaf order."""
    return _decode(tree, leaves)


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"manifest names unknown torch dtype {name!r}")
    return dt
