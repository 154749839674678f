"""Records what DeepSpeed hands its checkpoint engine, to re-check docs/design.md ("How the DeepSpeed adapter hooks DeepSpeed") on a new version.

Runs the harness with `ProbeCheckpoint` as backend and writes, per rank, `probe.rank<r>.json`:
- every CheckpointEngine call of save_checkpoint, in order (create/makedirs/save/commit) with its path,
- for each save(): the state dict's structure, each tensor's dtype/shape, whether it shares storage
  with the live module/optimizer, whether the next training step changed it in place (so a capture
  must copy it before the step goes on), and every value that is not a plain Python/tensor type,
- every filesystem probe load_checkpoint makes (isfile/exists/glob/listdir/open) and engine.load().

    python tests/ds_state_probe.py OUT_DIR [stage dtype world_size]...   # -> OUT_DIR/z*/summary.txt
"""
import enum
import json
import os
import sys
from pathlib import Path

import ds_harness

PLAIN = (str, int, float, bool, type(None))


def _describe(obj, path, out, live_ptrs, keep):
    import torch
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        out.append({"path": path, "kind": "tensor", "dtype": str(obj.dtype).replace("torch.", ""),
                    "shape": list(obj.shape), "aliases_live": ptr in live_ptrs})
        keep.append((path, obj, obj.detach().clone()))
    elif type(obj) in (list, tuple) and len(obj) > 8 and all(type(x) in PLAIN for x in obj):
        out.append({"path": path, "kind": f"{type(obj).__name__} of {len(obj)} {type(obj[0]).__name__}"})
    elif type(obj) in (dict, list, tuple):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        if not obj:
            out.append({"path": path, "kind": type(obj).__name__ + " (empty)"})
        for k, v in items:
            if type(k) not in (str, int):
                out.append({"path": f"{path}<key>", "kind": "nonplain", "type": _qual(k), "repr": repr(k)[:80]})
            if path or k != "harness_ranks":  # the harness's own client_state, not DeepSpeed's
                _describe(v, f"{path}.{k}" if path else str(k), out, live_ptrs, keep)
    elif type(obj) in PLAIN:  # exact type: IntEnum members (ZeroStageEnum) are not plain
        out.append({"path": path, "kind": type(obj).__name__, "value": obj if not isinstance(obj, str)
                    or len(obj) < 60 else obj[:60] + "..."})
    else:
        entry = {"path": path, "kind": "nonplain", "type": _qual(obj), "repr": repr(obj)[:80]}
        out.append(entry)
        # Containers that subclass dict (OrderedDict) and objects with plain attributes (LossScaler):
        # their contents matter for serialising without pickle.
        if isinstance(obj, dict):
            _describe(dict(obj), path, out, live_ptrs, keep)
        elif isinstance(obj, enum.Enum):
            entry["value"] = obj.value
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            entry["attrs"] = {k: _qual(v) for k, v in vars(obj).items()}


def _qual(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _live_storage_ptrs(engine):
    import torch
    ptrs = set()

    def add(x, depth=0):
        if isinstance(x, torch.Tensor):
            ptrs.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)) and depth < 3:
            for y in x:
                add(y, depth + 1)
        elif isinstance(x, dict) and depth < 3:
            for y in x.values():
                add(y, depth + 1)

    for t in list(engine.module.parameters()) + list(engine.module.buffers()):
        add(t)
        add(getattr(t, "ds_tensor", None))
    opt = engine.optimizer
    for o in {id(opt): opt, id(getattr(opt, "optimizer", opt)): getattr(opt, "optimizer", opt)}.values():
        add(list(getattr(o, "state", {}).values()))
        for v in vars(o).values():
            add(v)
    return ptrs


class RecordingEngine:
    """Wraps the engine DeepSpeed built: records each call, then delegates (so loads still work)."""

    def __init__(self, inner, log, live_ptrs, keep):
        self.inner, self.log, self.live_ptrs, self.keep = inner, log, live_ptrs, keep

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("create", "makedirs", "commit", "load"):
            def call(*a, **kw):
                self.log.append({"call": name, "args": [repr(x) for x in a] + [f"{k}={v!r}" for k, v in kw.items()]})
                return attr(*a, **kw)
            return call
        return attr

    def save(self, state_dict, path):
        tree = []
        _describe(state_dict, "", tree, self.live_ptrs, self.keep)
        self.log.append({"call": "save", "path": path, "tree": tree})
        return self.inner.save(state_dict, path)


class ProbeCheckpoint(ds_harness.StockCheckpoint):
    """Saves twice (steps s, s+1): the second save tells which tensors of the first changed in place."""

    def __init__(self, engine, ckpt_dir):
        super().__init__(engine, ckpt_dir)
        self.rank = int(os.environ["RANK"])
        self.record = {"saves": [], "load": None}
        self.keep = []

    def _dump(self):
        out = Path(self.ckpt_dir).parent / f"probe.rank{self.rank}.json"
        out.write_text(json.dumps(self.record, indent=1, default=str))

    def save(self, step, rank_state):
        mutated = [p for p, ref, copy in self.keep if not _same(ref, copy)]
        if self.keep:
            self.record["saves"][-1]["mutated_by_next_step"] = mutated
        self.keep = []
        log = []
        real = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = RecordingEngine(real, log, _live_storage_ptrs(self.engine), self.keep)
        try:
            super().save(step, rank_state)
        finally:
            self.engine.checkpoint_engine = real
        self.record["saves"].append({"step": step, "calls": log})
        self._dump()

    def load(self):
        log = []
        real = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = RecordingEngine(real, log, set(), [])
        with _fs_probe(log):
            try:
                return super().load()
            finally:
                self.engine.checkpoint_engine = real
                self.record["load"] = log
                self._dump()


def _same(a, b):
    import torch
    return torch.equal(a.detach().float(), b.float()) if a.numel() else True


class _fs_probe:
    """os.stat-based checks have no audit event, so those are wrapped; the rest come from audit hooks."""
    active = None

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.saved = [(os.path, n, getattr(os.path, n)) for n in ("isfile", "exists", "isdir")]
        for mod, name, fn in self.saved:
            setattr(mod, name, self._wrap(name, fn))
        _fs_probe.active = self
        if not getattr(_fs_probe, "hooked", False):
            sys.addaudithook(_audit)  # cannot be removed again, hence the `active` switch
            _fs_probe.hooked = True

    def _wrap(self, name, fn):
        def probe(p, *a, **kw):
            r = fn(p, *a, **kw)
            if _fs_probe.active is self:
                self.log.append({"fs": f"os.path.{name}", "path": str(p), "result": r})
            return r
        return probe

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)
        _fs_probe.active = None


def _audit(event, args):
    probe = _fs_probe.active
    if probe is None or event not in ("open", "glob.glob", "os.listdir", "os.scandir"):
        return
    path = str(args[0])
    if event == "open" and "/ckpt" not in path:
        return  # imports and /proc reads are noise
    _fs_probe.active = None  # the log append must not recurse
    try:
        probe.log.append({"fs": event, "path": path, "mode": str(args[1]) if event == "open" else None})
    finally:
        _fs_probe.active = probe


def probe(out_dir, stage, dtype, world_size, save_step=3):
    cfg = ds_harness.HarnessConfig(stage=stage, dtype=dtype, world_size=world_size, steps=save_step + 2)
    work = Path(out_dir) / f"z{stage}-{dtype}-w{world_size}"
    backend = "ds_state_probe:ProbeCheckpoint"
    ds_harness.run(cfg, work / "save", ckpt_dir=work / "ckpt", save_at=(save_step, save_step + 1), backend=backend)
    # The load record is written next to the checkpoint; a fresh run loads the newest tag.
    for r in range(world_size):
        os.replace(work / f"probe.rank{r}.json", work / f"probe.save.rank{r}.json")
    ds_harness.run(cfg, work / "load", ckpt_dir=work / "ckpt", resume=True, backend=backend)
    (work / "summary.txt").write_text(summarize(work, world_size))
    return work


def summarize(work, world_size) -> str:
    """The first save's calls and leaves per rank, then the load's calls: what NOTES section 3/4 cite."""
    lines = []
    for r in range(world_size):
        first = json.loads((work / f"probe.save.rank{r}.json").read_text())["saves"][0]
        lines.append(f"## rank {r}: save step {first['step']}; changed in place by the next step: "
                     f"{first.get('mutated_by_next_step')}")
        for call in first["calls"]:
            lines.append(f"  {call['call']} {call.get('path') or ' '.join(call['args'])}")
            for leaf in call.get("tree", []):
                if not leaf["path"].startswith("ds_config."):
                    lines.append(f"      {leaf['path']}: " + ", ".join(f"{k}={v}" for k, v in leaf.items() if k != "path"))
        load = json.loads((work / f"probe.rank{r}.json").read_text())["load"]
        lines.append(f"## rank {r}: load")
        lines += [f"  {e.get('fs') or e.get('call')} {e.get('path') or ' '.join(e.get('args', []))}"
                  + (f" -> {e['result']}" if "result" in e else "") for e in load]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = sys.argv[1]
    combos = [(int(a), b, int(c)) for a, b, c in zip(*[iter(sys.argv[2:])] * 3)] or \
        [(s, d, 2) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
    for stage, dtype, ws in combos:
        print(probe(out, stage, dtype, ws), flush=True)
