"""DeepSpeed's pipeline engine (a PipelineModule, ZeRO-0/1) under the adapter: what differs from a plain engine.

- Training runs through train_batch(), which does forward, backward and the optimizer step in one call
  (engine.step() raises): the snapshot's fence goes before the optimizer step inside it (_take_model_step),
  the snapshot after it returns.
- save_checkpoint writes the weights as one file per layer (`layer_XX-model_states.pt`, XX the layer's
  global index), on DP rank 0 only. A snapshot takes them from the module on every DP replica instead, so
  the replicas split their share as they do the model states; they are kept beside DeepSpeed's files and
  handed back layer by layer on restore (DeepSpeed would glob the checkpoint directory for them).
- Shard-map keys name a parameter by its layer: `layer_XX.<name inside the layer>`, for weights and
  optimizer state alike, so the key is the same whichever stage holds the layer (DeepSpeed's own
  `tied_modules.<key>.` and `<index>.` prefixes of the module's parameter names are not). A tied layer
  (embedding and LM head) is keyed at its first index; every stage that holds it stores a copy, and the
  stage of that first index holds the main one. A snapshot of one pipeline layout loads into another (stages
  and DP size, ZeRO-1) by those keys (reshard.load, with this class naming the keys).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

from ...errors import ConfigError
from ...snapshot import annotate
from ...snapshot.annotate import OPTIMIZER_STATE, optimizer_key
from . import shards

_LAYER_PREFIX = "layer_"


class Pipeline:
    def __init__(self, engine):
        from deepspeed.pipe import TiedLayerSpec

        module = engine.module
        self.engine, self.module = engine, module
        self.stage, self.stages = int(engine.stage_id), int(engine.num_stages)
        self._parts = list(module.parts)  # stage s holds layers [parts[s], parts[s+1])
        self._tied_at: dict[str, int] = {}  # tied key -> the first layer index that uses it
        self._canonical: dict[int, int] = {}  # layer index -> the index its weights are keyed at
        for idx, spec in enumerate(module._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                self._canonical[idx] = self._tied_at.setdefault(spec.key, idx)

    # ---- keys ---------------------------------------------------------------------------------------------
    @staticmethod
    def layer_key(idx: int, name: str) -> str:
        return f"{_LAYER_PREFIX}{idx:02d}.{name}"

    def _holds(self, idx: int) -> bool:
        return self._parts[self.stage] <= idx < self._parts[self.stage + 1]

    def param_key(self, name: str) -> tuple[str, bool]:
        """A module parameter name (`3.weight`, `tied_modules.embed.weight`) -> (its layer key, whether this
        stage holds the main copy)."""
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            tied, _, rest = rest.partition(".")
            idx = self._tied_at[tied]
            return self.layer_key(idx, rest), self._holds(idx)
        return self.layer_key(int(head), rest), True

    def key_of(self, name: str) -> str:
        return self.param_key(name)[0]

    def names(self) -> dict[str, str]:
        """This stage's module parameter names -> their layer keys, kept in every snapshot: an export writes
        DeepSpeed's own names (a universal checkpoint's `zero/<name>/`), which a tied parameter's key alone does
        not give back."""
        return {name: self.key_of(name) for name, _ in self.module.named_parameters()}

    def held_elsewhere(self, key: str) -> bool:
        """Whether a parameter's layer key (`layer_XX.<name>`) names a layer of another stage."""
        head, _, _ = key.partition(".")
        return head.startswith(_LAYER_PREFIX) and not self._holds(int(head[len(_LAYER_PREFIX):]))

    def rekey(self, tree):
        """Re-key, in place, the optimizer-state specs in `tree` (shards.with_specs' output, whose Sharded
        wrappers are its own) from module parameter names to layer keys."""
        return shards.rekey_specs(tree, self._rekeyed)

    def _rekeyed(self, spec):
        if not spec.key.startswith(OPTIMIZER_STATE):
            return spec
        kind, name = spec.key[len(OPTIMIZER_STATE):].split(".", 1)
        key, main = self.param_key(name)
        return dataclasses.replace(spec, key=optimizer_key(kind, key), main=spec.main and main)

    # ---- layer files --------------------------------------------------------------------------------------
    def _layers(self):
        """(global index, layer) of this stage's layers that have weights, as save_state_dict walks them."""
        start = self.module._local_start
        return [(start + i, layer) for i, layer in enumerate(self.module.forward_funcs)
                if hasattr(layer, "state_dict")]

    @staticmethod
    def file_name(idx: int) -> str:
        return f"{_LAYER_PREFIX}{idx:02d}-model_states.pt"

    def layer_files(self) -> dict[str, dict]:
        """This stage's layer files, with specs: the weights as save_checkpoint would write them. A tied
        layer's weights are main in the file of its first index only."""
        out = {}
        for idx, layer in self._layers():
            at = self._canonical.get(idx, idx)
            out[self.file_name(idx)] = annotate.state_dict(layer.state_dict(), main=at == idx,
                                                           prefix=self.layer_key(at, ""))
        return out

    @staticmethod
    def without_layer_files(files: dict) -> dict:
        """DeepSpeed's files minus the layer files it wrote (DP rank 0 only): layer_files() stands for them."""
        return {n: sd for n, sd in files.items() if not n.startswith(_LAYER_PREFIX)}

    @contextlib.contextmanager
    def serving(self, layers: dict):
        """While DeepSpeed loads a restored snapshot: the module reads its layers from `layers` (the snapshot's
        layer files) instead of globbing the checkpoint directory for them."""
        module = self.module

        def load_state_dir(load_dir, checkpoint_engine, strict=True):
            for idx, layer in self._layers():
                layer.load_state_dict(layers[self.file_name(idx)], strict=strict)
            module._synchronize_tied_weights()

        module.load_state_dir = load_state_dir
        try:
            yield
        finally:
            del module.load_state_dir

    # ---- training loop ------------------------------------------------------------------------------------
    def wrap(self, before_update, after_update) -> None:
        """train_batch() runs the optimizer step inside: `before_update()` right before it (the fence),
        `after_update(global steps before the batch, its loss)` once the batch is done (heartbeat, the check
        after a restore, snapshot). train_batch's loss is the batch's mean over micro-batches and replicas,
        which DeepSpeed broadcasts from the last stage to every stage: every rank screens the same value."""
        engine = self.engine
        take, train = engine._take_model_step, engine.train_batch

        @functools.wraps(take)
        def wrapped_take(*a, **kw):
            before_update()
            return take(*a, **kw)

        @functools.wraps(train)
        def wrapped_train(*a, **kw):
            before = engine.global_steps
            out = train(*a, **kw)
            after_update(before, out)
            return out

        engine._take_model_step, engine.train_batch = wrapped_take, wrapped_train


def check_reshard(engine, old_pp: int) -> None:
    """A pipeline snapshot's keys name layers, not the module's parameters: it reshards into another
    PipelineModule only (whose layers a mismatch then names)."""
    if old_pp > 1 and not getattr(engine, "pipeline_parallelism", False):
        raise ConfigError(f"inmem_ft: the snapshot was taken with {old_pp} pipeline stages and this model is no "
                          f"PipelineModule: restart with the PipelineModule it was taken with (any number of "
                          f"stages, ZeRO-1)")
