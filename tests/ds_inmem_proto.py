"""Test-only prototype of the DeepSpeed hook the adapter will use; not the adapter.

It checks, against real DeepSpeed, the three things the recommended integration relies on
(docs/deepspeed-checkpoint-flow.md, "Recommended integration"):
1. A CheckpointEngine assigned to `engine.checkpoint_engine` after `deepspeed.initialize` receives every
   state dict `save_checkpoint` writes, and can turn each into (JSON manifest, raw tensor bytes) with a
   closed set of types: no pickle. `encode` raises on any type outside that set.
2. Stock `load_checkpoint` restores everything from such an engine when the tag directory holds
   zero-byte files with the stock names: DeepSpeed only globs/stats them; all content comes from
   `engine.load(path)`.
3. Per-rank state (RNG, data position) must be captured beside DeepSpeed's files, since ZeRO-0/1/2
   keep client_state only in DP rank 0's model-states file.

The directory `store/` stands in for the SMP; a shared directory also stands in for the peer read that
ranks other than 0 need for `mp_rank_00_model_states.pt`.
"""
import dataclasses
import enum
import importlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

# Every non-plain type DeepSpeed 0.19.8 puts in a checkpoint (ZeRO 0-3, fp32/bf16, fp16 loss scalers),
# plus numpy arrays for RNG states. Decoding imports only these names.
ALLOWED = {
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
}


def _qualname(obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _import(qualname):
    if qualname not in ALLOWED:
        raise TypeError(f"refusing to rebuild {qualname}: not in ALLOWED")
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def encode(obj, tensors):
    """-> JSON-able tree; tensor payloads are appended to `tensors` as fresh CPU byte copies."""
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if isinstance(obj, torch.Tensor):
        # The copy happens here, before save() returns: DeepSpeed hands over live tensors.
        data = obj.detach().reshape(-1).contiguous().cpu().view(torch.uint8).clone()
        tensors.append(data)
        return {"T": [len(tensors) - 1, str(obj.dtype).removeprefix("torch."), list(obj.shape)]}
    if t in (dict, OrderedDict):  # keys may be ints (optimizer state) and order matters (param_shapes)
        return {"od" if t is OrderedDict else "d": [[encode(k, tensors), encode(v, tensors)] for k, v in obj.items()]}
    if t in (list, tuple):
        return {"l" if t is list else "t": [encode(v, tensors) for v in obj]}
    if t is torch.Size:
        return {"size": list(obj)}
    if t is torch.dtype:
        return {"dtype": str(obj).removeprefix("torch.")}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):  # numpy RNG state
        return {"np": encode(torch.from_numpy(obj.copy()), tensors)}
    name = _qualname(obj)
    if name not in ALLOWED:
        raise TypeError(f"cannot serialise {name} without pickle; extend ALLOWED and the decoder")
    if isinstance(obj, enum.Enum):
        return {"enum": [name, obj.value]}
    if dataclasses.is_dataclass(obj):
        return {"dc": [name, encode({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, tensors)]}
    return {"obj": [name, encode(dict(vars(obj)), tensors)]}


def decode(node, tensors):
    if not isinstance(node, dict):
        return node
    (tag, val), = node.items()
    if tag == "T":
        idx, dtype, shape = val
        return tensors[idx].view(getattr(torch, dtype)).reshape(shape)
    if tag in ("d", "od"):
        items = [(decode(k, tensors), decode(v, tensors)) for k, v in val]
        return OrderedDict(items) if tag == "od" else dict(items)
    if tag in ("l", "t"):
        items = [decode(v, tensors) for v in val]
        return items if tag == "l" else tuple(items)
    if tag == "size":
        return torch.Size(val)
    if tag == "dtype":
        return getattr(torch, val)
    if tag == "np":
        return decode(val, tensors).numpy()
    name, payload = val
    cls = _import(name)
    if tag == "enum":
        return cls(payload)
    fields = decode(payload, tensors)
    if tag == "dc":
        return cls(**fields)
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


ALIGN = 64  # so every tensor can be viewed as its dtype in place


def write_entry(path: Path, obj):
    tensors = []
    manifest = encode(obj, tensors)
    offsets, pos = [], 0
    with open(f"{path}.bin", "wb") as f:
        for t in tensors:
            pad = -pos % ALIGN
            f.write(b"\0" * pad + t.numpy().tobytes())
            offsets.append([pos + pad, t.numel()])
            pos += pad + t.numel()
    Path(f"{path}.json").write_text(json.dumps({"tree": manifest, "tensors": offsets}))


def read_entry(path: Path):
    meta = json.loads(Path(f"{path}.json").read_text())
    raw = bytearray(Path(f"{path}.bin").read_bytes())
    tensors = [torch.frombuffer(raw, dtype=torch.uint8, offset=o, count=n) if n else torch.empty(0, dtype=torch.uint8)
               for o, n in meta["tensors"]]
    return decode(meta["tree"], tensors)


class StoreCheckpointEngine(CheckpointEngine):
    """Maps DeepSpeed's file paths to entries `<store>/<tag>/<file name>.{json,bin}`."""

    def __init__(self, store: Path, rank: int):
        super().__init__()
        self.name, self.store, self.rank = "inmem-proto", Path(store), rank

    def _entry(self, path):
        path = Path(path)
        return self.store / path.parent.name / path.name

    def create(self, info):
        (self.store / info.tag).mkdir(parents=True, exist_ok=True)

    def makedirs(self, path, exist_ok=False):
        # Still real: DeepSpeed copies zero_to_fp32.py into save_dir and writes `latest` with open().
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path):
        write_entry(self._entry(path), state_dict)

    def load(self, path, map_location=None):
        return read_entry(self._entry(path))

    def commit(self, info):
        (self.store / info.tag / f"COMMIT.rank{self.rank}").touch()
        return True

    def preserves_storage_sharing(self):
        return False  # encode() copies each view's own elements; DeepSpeed need not clone first


class ProtoCheckpoint:
    """Harness backend (see ds_harness): DeepSpeed's save/load flow through StoreCheckpointEngine."""

    def __init__(self, engine, ckpt_dir):
        import deepspeed.comm as dist
        self.engine, self.dir = engine, Path(ckpt_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = self.dir / "store"
        engine.checkpoint_engine = StoreCheckpointEngine(self.store, self.rank)

    def save(self, step, rank_state):
        tag = f"step{step}"
        # save_latest=False: "latest" would be a real file; the store's COMMIT markers decide instead.
        self.engine.save_checkpoint(self.dir / "scratch", tag=tag, save_latest=False)
        write_entry(self.store / tag / f"rank_state.{self.rank}", rank_state)
        # Written after save_checkpoint's closing barrier, so every rank's DeepSpeed files are in.
        (self.store / tag / f"DONE.rank{self.rank}").touch()

    def _complete_tags(self):
        done = lambda d: all((d / f"DONE.rank{r}").exists() for r in range(self.world))
        tags = [d for d in self.store.glob("step*") if done(d)] if self.store.exists() else []
        return sorted(tags, key=lambda d: int(d.name.removeprefix("step")))

    def load(self):
        tags = self._complete_tags()
        if not tags:
            return None
        tag_dir = tags[-1]
        skeleton = self.dir / f"skeleton.rank{self.rank}"
        (skeleton / tag_dir.name).mkdir(parents=True, exist_ok=True)
        for entry in tag_dir.glob("*.json"):
            if entry.name.endswith(".pt.json"):
                (skeleton / tag_dir.name / entry.name.removesuffix(".json")).touch()
        path, _ = self.engine.load_checkpoint(skeleton, tag=tag_dir.name)
        assert path is not None
        return read_entry(tag_dir / f"rank_state.{self.rank}")
