"""A training state (nested containers of tensors, arrays and plain values) <-> a JSON tree plus leaves.

Tensors and numpy arrays become numbered leaves whose bytes travel separately; everything else is encoded
in JSON with one-key tags, so decoding is a pure data walk: nothing is unpickled and nothing imported.
Python and numpy RNG states are plain tuples/arrays and ride along with no special case. A torch.Generator
(Transformer Engine's graph-safe RNG tracker holds them, on any device) is stored as its state tensor, a host
uint8 leaf from get_state(), and comes back as a Generator of the same device with set_state(). An
io.BytesIO (Transformer Engine's `_extra_state` in older releases) is stored as its bytes and comes back a
BytesIO at position 0; what is inside is the owner's to decode (TE torch.loads it itself), never ours.
"""
from __future__ import annotations

import base64
import gc
import io
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
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


def nbytes(value) -> int:
    """Bytes of a tensor's or array's elements."""
    return int(value.nbytes) if isinstance(value, np.ndarray) else value.numel() * value.element_size()


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
        return nbytes(self.value)

    @property
    def dtype_name(self) -> str:
        return self.value.dtype.str if self.is_array else str(self.value.dtype).removeprefix("torch.")


@dataclass
class FlatState:
    skeleton: Any
    """The JSON tree, but for the bulk dicts listed in `lazy` (see `tree`)."""
    values: list = field(default_factory=list)
    """The leaves' tensors and arrays in leaf order, as the caller holds them (copies run under no_grad)."""
    replicated: list[tuple[int, int]] = field(default_factory=list)
    """Leaf index ranges [start, end) first met under a Replicated marker."""
    shards: dict[int, tuple[ShardSpec, ...]] = field(default_factory=dict)
    lazy: list = field(default_factory=list)

    @property
    def tree(self) -> Any:
        """The state's JSON tree. Its bulk dicts (10^5 keys of a state dict) are spelled out on first use,
        which for a snapshot under a reused layout is on the commit thread."""
        for container, key in self.lazy:
            container[key] = container[key].spelled()
        self.lazy = []
        return self.skeleton

    @cached_property
    def leaves(self) -> list[Leaf]:
        """One Leaf per value, for planning. The snapshot hot path uses `values` and never builds these."""
        rep = bytearray(len(self.values))
        for a, b in self.replicated:
            rep[a:b] = b"\x01" * (b - a)
        return [Leaf(v, bool(rep[i]), self.shards.get(i, ())) for i, v in enumerate(self.values)]

    def path_of(self, leaf: int) -> str:
        """Where leaf `leaf` sits in the state, for error messages (a walk of the tree: not for hot paths)."""
        def find(node, path):
            if isinstance(node, list):
                items = ((f"{path}[{i}]", v) for i, v in enumerate(node))
            elif isinstance(node, dict) and len(node) == 1 and next(iter(node)) in ("T", "A"):
                return path if next(iter(node.values())) == leaf else None
            elif isinstance(node, dict):
                (tag, val), *_ = node.items()
                if tag in ("d", "od"):
                    items = ((f"{path}.{k}", v) for k, v in val.items())
                elif tag == "dk":
                    items = ((f"{path}[{i}]", v) for i, (_, v) in enumerate(val))
                else:
                    items = ((path, v) for v in (val if tag == "tu" else [val]))
            else:
                return None
            for p, v in items:
                found = find(v, p)
                if found:
                    return found
            return None

        return find(self.tree, "state") or f"leaf #{leaf}"


# Containers at least this long whose values are all plain tensors take the bulk path: one C-level pass per
# container instead of a Python call per element (a 10^5-tensor state dict is one such container).
_BULK_MIN = 8
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_JSON_PLAIN = frozenset({str, int, bool, type(None)})  # exact types JSON holds as they are
# {"T": i} of the bulk path, shared by every tree: a tree is only ever read (encoded to JSON), never changed.
_TENSOR_REFS: list[dict] = []


def _tensor_refs(start: int, n: int) -> list[dict]:
    if len(_TENSOR_REFS) < start + n:
        _TENSOR_REFS.extend({"T": i} for i in range(len(_TENSOR_REFS), start + n))
    return _TENSOR_REFS[start: start + n]


class _Keyed:
    """A dict's keys over tensor leaves start, start+1, ...: the dict of refs is built when the tree is read."""

    __slots__ = ("keys", "start")

    def __init__(self, keys: list, start: int):
        self.keys, self.start = keys, start

    def spelled(self) -> dict:
        return dict(zip(self.keys, _tensor_refs(self.start, len(self.keys))))


class _Refused(Exception):
    """A value that cannot be stored; containers add their key on the way up, so the path is only built on
    failure."""

    def __init__(self, reason: str):
        self.reason, self.where = reason, []

    def at(self, step: str) -> "_Refused":
        self.where.append(step)
        return self


class _Flattener:
    def __init__(self, bulk: bool = True):
        self.values: list = []
        self.replicated: list[tuple[int, int]] = []
        self.shards: dict[int, tuple[ShardSpec, ...]] = {}
        self.lazy: list = []
        self._seen: dict[int, int] = {}  # id(tensor) -> leaf index: tied weights are stored once
        # Bulk runs are not checked against _seen one by one: flatten() checks all their ids at once at the
        # end, and walks again without bulk runs if a tensor is met twice.
        self._bulk = bulk
        self.bulk_ids: list[int] = []
        self._in_replicated = False

    def leaf(self, value, key: int, shards=()) -> dict:
        # Keyed by the caller's object, which the state keeps alive, so ids cannot be recycled meanwhile.
        idx = self._seen.get(key)
        if idx is None:
            idx = self._seen[key] = len(self.values)
            self.values.append(value)
            if shards:
                self.shards[idx] = shards
        return {"A": idx} if isinstance(value, np.ndarray) else _tensor_refs(idx, 1)[0]

    def bulk(self, values: list, types: set) -> int | None:
        """The leaf index of the first of a run of plain tensors (of `types`), added in C-level passes; None
        when the run is short or holds anything else (then element by element)."""
        if not self._bulk or len(values) < _BULK_MIN or not types <= _PLAIN_TENSORS:
            return None
        start = len(self.values)
        self.values.extend(values)
        self.bulk_ids.extend(map(id, values))
        return start

    def unique(self) -> bool:
        """No tensor of a bulk run was met anywhere else."""
        ids = set(self.bulk_ids)
        return len(ids) == len(self.bulk_ids) and ids.isdisjoint(self._seen)

    def encode(self, obj: Any) -> Any:
        kind = type(obj)  # the usual types first, by identity; subclasses and the rest below
        if kind in _JSON_PLAIN:
            return obj
        if kind is dict or kind is OrderedDict:
            return self.mapping(obj)
        if kind in _PLAIN_TENSORS:
            return self.leaf(obj, id(obj))
        if kind is list:
            return self.sequence(obj)
        if kind is tuple:
            return {"tu": self.sequence(obj)}
        if kind is Sharded:
            return self.leaf(obj.tensor, id(obj.tensor), obj.specs)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"f": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self.leaf(obj, id(obj))
        if isinstance(obj, Sharded):
            return self.leaf(obj.tensor, id(obj.tensor), obj.specs)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise _Refused("numpy array of Python objects cannot be stored without pickle")
            return self.leaf(obj, id(obj))
        if isinstance(obj, np.generic):
            return {"np": obj.dtype.str, "v": self.encode(obj.item())}
        if isinstance(obj, Replicated):
            if self._in_replicated:
                return self.encode(obj.tree)
            self._in_replicated, start = True, len(self.values)
            try:
                return {"R": self.encode(obj.tree)}
            finally:
                self._in_replicated = False
                if len(self.values) > start:
                    self.replicated.append((start, len(self.values)))
        if isinstance(obj, dict):
            return self.mapping(obj)
        if isinstance(obj, list):
            return self.sequence(obj)
        if type(obj) is tuple:
            return {"tu": self.sequence(obj)}
        if isinstance(obj, bytes):
            return {"b": base64.b64encode(obj).decode()}
        if type(obj) is io.BytesIO:
            return {"bio": base64.b64encode(obj.getvalue()).decode()}
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        if isinstance(obj, torch.Generator):
            return self.generator(obj)
        return self.registered(obj)

    def generator(self, gen: torch.Generator) -> dict:
        """The generator's state as a leaf, read now (the state object the capture copies later is this copy);
        a generator met twice is one leaf, and one Generator again on restore."""
        idx = self._seen.get(id(gen))
        if idx is None:
            idx = self._seen[id(gen)] = len(self.values)
            self.values.append(gen.get_state())  # a host uint8 tensor on every device type
        return {"gen": _tensor_refs(idx, 1)[0], "dev": str(gen.device)}

    def sequence(self, obj) -> list:
        types = set(map(type, obj))
        if types <= _JSON_PLAIN:  # parameter ids and the like
            return list(obj)
        start = self.bulk(obj if type(obj) is list else list(obj), types)
        if start is not None:
            return _tensor_refs(start, len(obj))
        out = []
        for i, v in enumerate(obj):
            try:
                out.append(self.encode(v))
            except _Refused as e:
                raise e.at(f"[{i}]")
        return out

    def mapping(self, obj: dict) -> dict:
        ordered = type(obj) is OrderedDict
        if type(obj) not in (dict, OrderedDict):
            if not safe_types.is_registered(type(obj)):
                raise _Refused(f"dict subclass {type(obj).__qualname__} is not registered; "
                               f"call inmem_ft.snapshot.register_safe_class({type(obj).__qualname__})")
        if len(obj) < _BULK_MIN:
            str_keys, start = all(isinstance(k, str) for k in obj), None
        else:
            keys = list(obj)
            str_keys = set(map(type, keys)) <= {str} or all(isinstance(k, str) for k in keys)
            values = list(obj.values()) if str_keys else []
            start = self.bulk(values, set(map(type, values))) if str_keys else None
        if str_keys:
            if start is not None:
                items = _Keyed(keys, start)
            else:
                items = {}
                for k, v in obj.items():
                    try:
                        items[k] = self.encode(v)
                    except _Refused as e:
                        raise e.at(f".{k}")
            out = {"od" if ordered else "d": items}
            if start is not None:
                self.lazy.append((out, "od" if ordered else "d"))
        else:
            pairs = []
            for k, v in obj.items():
                try:
                    ek = self.encode(k)
                except _Refused as e:
                    raise e.at("<key>")
                try:
                    pairs.append([ek, self.encode(v)])
                except _Refused as e:
                    raise e.at(f"[{k!r}]")
            out = {"dk": pairs, "o": ordered}
        # nn.Module.state_dict() carries per-module versions here; load_state_dict reads them.
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            try:
                out["m"] = self.encode(dict(meta))
            except _Refused as e:
                raise e.at("._metadata")
        return out

    def registered(self, obj: Any) -> dict:
        cls = type(obj)
        if not safe_types.is_registered(cls):
            raise _Refused(
                f"value of type {cls.__module__}.{cls.__qualname__} cannot be stored without pickle; "
                f"convert it to plain data, or allow it with inmem_ft.snapshot.register_safe_class("
                f"{cls.__qualname__}) if its __dict__ holds only data")
        name = safe_types.class_name(cls)
        if safe_types.is_enum(cls):
            return {"enum": name, "v": self.encode(obj.value)}
        return {"obj": name, "s": self.encode(dict(vars(obj)))}


def flatten(state: Any) -> FlatState:
    """The state as a JSON tree plus its leaves. Cheap per tensor: the bytes, dtypes and shapes are read by
    whoever plans and copies them."""
    # The walk only adds objects, and a 10^5-tensor state allocates enough of them to set off full garbage
    # collections over the whole heap, at random steps; the training thread should not pay for those here.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        f = _Flattener()
        tree = f.encode(state)
        if not f.unique():
            f = _Flattener(bulk=False)
            tree = f.encode(state)
    except _Refused as e:
        raise UnsafeType(f"state{''.join(reversed(e.where))}: {e.reason}") from None
    finally:
        if was_enabled:
            gc.enable()
    return FlatState(tree, f.values, f.replicated, f.shards, f.lazy)


def _decode(node: Any, leaves: list, generators: dict) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, leaves, generators) for v in node]
    (tag, val), *rest = node.items()
    if tag in ("T", "A"):
        return leaves[val]
    if tag in ("d", "od"):
        out = (OrderedDict if tag == "od" else dict)((k, _decode(v, leaves, generators)) for k, v in val.items())
        return _with_meta(out, rest, leaves, generators)
    if tag == "dk":
        ordered = dict(rest)["o"]
        out = (OrderedDict if ordered else dict)((_decode(k, leaves, generators), _decode(v, leaves, generators))
                                                 for k, v in val)
        return _with_meta(out, rest[1:], leaves, generators)
    if tag == "R":
        return _decode(val, leaves, generators)
    if tag == "tu":
        return tuple(_decode(v, leaves, generators) for v in val)
    if tag == "f":
        return float(val)
    if tag == "b":
        return base64.b64decode(val)
    if tag == "bio":
        return io.BytesIO(base64.b64decode(val))
    if tag == "np":
        return np.dtype(val).type(_decode(dict(rest)["v"], leaves, generators))
    if tag == "size":
        return torch.Size(val)
    if tag == "dtype":
        return dtype_from_name(val)
    if tag == "device":
        return torch.device(val)
    if tag == "gen":
        return _generator(val["T"], dict(rest)["dev"], leaves, generators)
    if tag == "enum":
        return safe_types.lookup(val)(_decode(dict(rest)["v"], leaves, generators))
    if tag == "obj":
        cls = safe_types.lookup(val)
        obj = cls.__new__(cls)
        vars(obj).update(_decode(dict(rest)["s"], leaves, generators))
        return obj
    raise ValueError(f"unknown manifest tag {tag!r}: snapshot written by a newer inmem_ft?")


def _generator(leaf: int, device: str, leaves: list, generators: dict) -> torch.Generator:
    if leaf not in generators:
        try:
            gen = torch.Generator(device=device)
        except RuntimeError as e:
            raise ValueError(f"the snapshot holds a torch.Generator of device {device!r}, which this process "
                             f"cannot create ({str(e).splitlines()[0]}): restore on a machine with that "
                             f"device") from None
        # A host uint8 tensor whatever the device, and a copy: a restored leaf may be a view into one restore
        # buffer, and set_state reads from the start of its storage (torch 2.13: a wrong state, or SIGSEGV).
        gen.set_state(leaves[leaf].cpu().clone())
        generators[leaf] = gen
    return generators[leaf]


def _with_meta(out, rest, leaves, generators):
    for key, meta in rest:
        if key == "m":
            out._metadata = _decode(meta, leaves, generators)
    return out


def unflatten(tree: Any, leaves: list) -> Any:
    """Rebuild the state; `leaves` holds the tensors/arrays in leaf order."""
    return _decode(tree, leaves, {})


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"manifest names unknown torch dtype {name!r}")
    return dt
